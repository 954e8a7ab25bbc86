"""The learned planner at planning time: joined operator + device graph features, the network's
forward pass (NumPy, no compilation) and its shipped weights.

Where this sits::

    cost  ->  gnn (this package: inference)  ->  strategies (auto)  ->  ...  ->  training (top)

``strategy="auto"`` uses the weights shipped in ``hulkjax/gnn/weights/``, trained by ``hulkjax
train-gnn`` (:mod:`hulkjax.training`); :func:`hulkjax.strategies.predict` shows what the network
proposes for a graph, :func:`history` how it was trained.

>>> import hulkjax as hj
>>> isinstance(hj.gnn.history(), dict)
True
"""

from hulkjax.gnn.features import JoinedGraph as JoinedGraph
from hulkjax.gnn.features import build as build
from hulkjax.gnn.infer import log_probs as log_probs
from hulkjax.gnn.weights import WEIGHTS_DIR as WEIGHTS_DIR
from hulkjax.gnn.weights import Weights as Weights
from hulkjax.gnn.weights import history as history
from hulkjax.gnn.weights import load as load
