"""Built-in training steps for demos, benchmarks and tests.

Each model is a pure, un-jitted ``train_step(state, batch) -> (new_state, metrics)`` with a frozen
config dataclass and size presets. ``state`` is ``{"params": ..., "opt_state": ...}`` (an optax
state; ResNet with BatchNorm adds ``"batch_stats"``), ``batch`` a dict whose every leaf has the batch
as dimension 0, ``metrics`` a dict of float32 scalars with at least ``"loss"``.

>>> from hulkjax import zoo
>>> zoo.names()[:3]
['mlp', 'mlp-nnx', 'transformer-block']
>>> m = zoo.get("gpt2", size="tiny")
>>> state, batch = m.init(seed=0)          # concrete arrays
>>> new_state, metrics = m.step(state, batch)
>>> abstract_state, abstract_batch = zoo.get("gpt2", size="1b").abstract()  # allocates nothing
"""

# Importing a model module registers it; zoo.names() lists them in this order (small to large).
# isort: off
from hulkjax.zoo import mlp as mlp
from hulkjax.zoo import transformer_block as transformer_block
from hulkjax.zoo import cnn as cnn
from hulkjax.zoo import gpt2 as gpt2
from hulkjax.zoo import llama as llama
from hulkjax.zoo import bert as bert
from hulkjax.zoo import vit as vit
from hulkjax.zoo import moe as moe
from hulkjax.zoo import resnet as resnet
# isort: on

from hulkjax.zoo._base import InvalidModelConfigError as InvalidModelConfigError
from hulkjax.zoo._base import TrainConfig as TrainConfig
from hulkjax.zoo._base import ZooModel as ZooModel
from hulkjax.zoo._base import describe as describe
from hulkjax.zoo._base import get as get
from hulkjax.zoo._base import names as names
from hulkjax.zoo._base import sizes as sizes
from hulkjax.zoo.bert import BERTConfig as BERTConfig
from hulkjax.zoo.cnn import CNNConfig as CNNConfig
from hulkjax.zoo.gpt2 import GPT2Config as GPT2Config
from hulkjax.zoo.llama import LlamaConfig as LlamaConfig
from hulkjax.zoo.mlp import MLPConfig as MLPConfig
from hulkjax.zoo.moe import MoEConfig as MoEConfig
from hulkjax.zoo.resnet import ResNetConfig as ResNetConfig
from hulkjax.zoo.transformer_block import TransformerBlockConfig as TransformerBlockConfig
from hulkjax.zoo.vit import ViTConfig as ViTConfig
