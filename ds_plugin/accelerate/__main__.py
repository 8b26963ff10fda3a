"""`python -m ds_plugin.accelerate [--ds-config C] script.py [args]`: see `ds_plugin.accelerate.bootstrap`."""

from ds_plugin.accelerate.bootstrap import main

if __name__ == "__main__":
    main()
