"""Training the planner network (``hulkjax train-gnn``): ILP-labelled data, the flax model, the loop.

Where this sits::

    training (this package, an application)  ->  strategies (ilp labels, auto's search)
                                              ->  gnn (features; writes its weights)  ->  zoo

The device-group head (:class:`~hulkjax.training.model.GroupHead`) is trained apart, on the
staged search over every order of a cluster's groups (:mod:`hulkjax.training.group_data`,
:mod:`hulkjax.training.groups`; ``hulkjax train-gnn --head groups``).

Only this package imports jraph and builds the flax module; planning runs the same network in
NumPy (:mod:`hulkjax.gnn.infer`), held equal to :class:`~hulkjax.training.model.PlannerNet` by the
tests.
"""

from hulkjax.training.model import GroupHead as GroupHead
from hulkjax.training.model import PlannerNet as PlannerNet
from hulkjax.training.train import run as run
from hulkjax.training.train import save as save
from hulkjax.training.train import train as train
from hulkjax.training.train import validate as validate
