"""`Fp8Precision`: FP8 training through the config's `fp8` block, passed to the Trainer as a plugin instance.

Lightning's precision strings are a closed list, so FP8 cannot be a `precision="..."` value; it is
`Trainer(strategy="zero3", plugins=Fp8Precision(recipe="rowwise"))` (or `Fabric(plugins=...)`). The plugin
only fills the config: the strategy swaps the eligible `nn.Linear` layers with
`ds_plugin.precision.fp8_linear.convert_to_fp8_training` before sharding, and a model with no eligible
layer fails setup with one line that says why.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from ds_plugin.config import from_deepspeed
from ds_plugin.strategies.lightning_precision import ZeroPrecision

__all__ = ["Fp8Precision"]


class Fp8Precision(ZeroPrecision):
    """FP8 GEMMs for eligible linear layers, the rest in `precision` (bf16 by default, as DeepSeek-V3 does).

    Args:
        precision: the precision of everything that is not an FP8 GEMM ("bf16-mixed", "32-true", ...).
        recipe: "tensorwise", "rowwise" or "blockwise" (DeepSeek-V3's 1x128 / 128x128 scaling).
        gradient_format: "e4m3" or "e5m2" for the output gradients; None keeps the config's default.
        all_gather: ZeRO-3: gather weights already cast to FP8.
        skip_modules: module-name substrings kept in high precision; None keeps the config's ("lm_head").

    Raises:
        ConfigError: a value the config's `fp8` block rejects (e.g. an unknown recipe), at construction.
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        *,
        recipe: str = "tensorwise",
        gradient_format: str | None = None,
        all_gather: bool = False,
        skip_modules: tuple[str, ...] | list[str] | None = None,
    ) -> None:
        super().__init__(precision)
        block: dict[str, Any] = {"enabled": True, "recipe": recipe, "all_gather": all_gather}
        if gradient_format is not None:
            block["gradient_format"] = gradient_format
        if skip_modules is not None:
            block["skip_modules"] = list(skip_modules)
        from_deepspeed({"fp8": block})  # a bad recipe or format fails here, not at setup
        self.fp8 = block

    @override
    def config_overrides(self) -> dict[str, Any]:
        return {"fp8": dict(self.fp8)}
