"""Decoder models (one module per family under rljax/models/families/) and their weight I/O."""
from rljax.models.config import LoraConfig, ModelConfig, RopeScaling
from rljax.models.outputs import ModelOutput
from rljax.models.policy import Policy, apply_model, init_params, output_kernel, param_logical_axes, param_shardings
from rljax.models.transformer import KVCache, Transformer, positions_from_mask
