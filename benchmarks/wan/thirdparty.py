"""Third-party model code for the WAN testbed (``testbed.py --model
benchmarks/wan/thirdparty.py:gpt2``): steps whose model hulkjax did not write, random-initialized,
nothing downloaded.

Each function returns ``(step, state, batch)``, the contract of ``hulkjax launch``'s
``file.py:function`` models; every process of the job calls it and gets the same arrays (the
families initialize from a fixed seed).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.realmodels import families  # noqa: E402  (the repository's root, above)


def gpt2():
    """Hugging Face transformers' ``FlaxGPT2LMHeadModule`` (4.x) at the families' ``small`` size:
    4 layers, width 256, 8 heads, vocab 8192, sequence 128, batch 16; value and grad of the loss
    and one optax adamw update."""
    return families.build("gpt2", "small")


def llama():
    """Hugging Face transformers' ``FlaxLlamaForCausalLMModule`` (4.x) at the ``small`` size
    (rotary embeddings, grouped-query attention)."""
    return families.build("llama", "small")
