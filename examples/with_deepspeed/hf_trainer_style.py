"""An HF Trainer script in the shape of transformers' examples/pytorch/language-modeling/run_clm.py, unchanged for
ds_plugin: the arguments parsed with `HfArgumentParser`, the DeepSpeed JSON given as `--deepspeed`. Started the way
DeepSpeed's launcher starts it, it trains on ds_plugin's engine:

    ds-plugin launch --num_gpus 2 examples/with_deepspeed/hf_trainer_style.py \
        --deepspeed examples/with_deepspeed/hf_ds_config_zero2.json --output_dir runs/hf_clm --use_cpu \
        --max_steps 20 --learning_rate 3e-3 --per_device_train_batch_size 4 --logging_steps 4

(`--use_cpu` only where there is no GPU.) The JSON is transformers' ZeRO-2 template, "auto" everywhere: the
Trainer's arguments fill it. Nothing is downloaded: the model is a small Llama built from a config, its tokens are
the bytes of `examples/data/tiny_corpus.txt`.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

CORPUS = Path(__file__).resolve().parents[1] / "data" / "tiny_corpus.txt"


@dataclass
class ModelArguments:
    hidden_size: int = field(default=64, metadata={"help": "the model's width"})
    layers: int = field(default=2, metadata={"help": "decoder layers"})
    block_size: int = field(default=32, metadata={"help": "tokens per training sequence"})


class ByteBlocks(torch.utils.data.Dataset):
    """The corpus as UTF-8 bytes (token = byte), cut into blocks of `block_size` tokens, as run_clm groups texts."""

    def __init__(self, block_size: int) -> None:
        ids = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
        count = ids.numel() // block_size
        self.blocks = ids[: count * block_size].view(count, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(training_args.seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=model_args.hidden_size, intermediate_size=4 * model_args.hidden_size,
        num_hidden_layers=model_args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=model_args.block_size,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=ByteBlocks(model_args.block_size))
    result = trainer.train()
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"accelerator: {type(trainer.accelerator).__module__}")
        print(f"train_loss: {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
