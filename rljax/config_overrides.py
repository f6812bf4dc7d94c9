"""Kept for existing imports: config files and `--config.a.b=value` overrides now live in the config
package (rljax/config/loading.py, rljax/config/overrides.py); import them from `rljax.config`."""
from rljax.config.loading import load_config_file
from rljax.config.overrides import apply_overrides, parse_value, set_field, split_config_args, split_gin_args

__all__ = ["apply_overrides", "load_config_file", "parse_value", "set_field", "split_config_args", "split_gin_args"]
