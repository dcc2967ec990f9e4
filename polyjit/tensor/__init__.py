"""``polyjit.tensor``: a thin array front end over the IR.

Tensors with shapes and dtypes build IR assignments; reverse-mode gradients
and optimizers build more of them; :func:`compile` links the whole graph into
one routine batch on a device and returns a :class:`Plan` that runs it with no
allocation per run; :func:`data_parallel` shards a training step across
devices and all-reduces the gradients through merge buffers.

>>> import numpy as np
>>> from polyjit import tensor as pt
>>> x = pt.input("x", (4, 3))
>>> w = pt.param("w", (3, 2), init="ones")
>>> plan = pt.compile({"y": pt.relu(x @ w)})
>>> plan.run(x=np.ones((4, 3), np.float32))["y"].tolist()
[[3.0, 3.0], [3.0, 3.0], [3.0, 3.0], [3.0, 3.0]]
"""

from polyjit.tensor.autograd import grad, topo_order
from polyjit.tensor.nn import (
    MLP,
    Linear,
    accuracy_count,
    cross_entropy,
    embedding,
    log_softmax,
    one_hot,
    softmax,
)
from polyjit.tensor.ops import (
    abs,
    add,
    broadcast_to,
    cast,
    concat,
    detach,
    div,
    einsum,
    elementwise,
    equal,
    exp,
    gather,
    getitem,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    mul,
    neg,
    not_equal,
    pow,
    relu,
    reshape,
    scatter_add,
    sigmoid,
    sqrt,
    sub,
    sum,
    sum_to,
    tanh,
    transpose,
    where,
)
from polyjit.tensor.optim import SGD, Adam, AdamW, Optimizer
from polyjit.tensor.parallel import DataParallel, data_parallel
from polyjit.tensor.plan import AUTO_DYNAMIC_STEPS, Plan, compile, trainable_params
from polyjit.tensor.program import Program, Write
from polyjit.tensor.tensor import (
    Kind,
    Tensor,
    arange,
    constant,
    full,
    input,
    ones,
    param,
    state,
    zeros,
)

__all__ = [
    "AUTO_DYNAMIC_STEPS",
    "MLP",
    "SGD",
    "Adam",
    "AdamW",
    "DataParallel",
    "Kind",
    "Linear",
    "Optimizer",
    "Plan",
    "Program",
    "Tensor",
    "Write",
    "abs",
    "accuracy_count",
    "add",
    "arange",
    "broadcast_to",
    "cast",
    "compile",
    "concat",
    "constant",
    "cross_entropy",
    "data_parallel",
    "detach",
    "div",
    "einsum",
    "elementwise",
    "embedding",
    "equal",
    "exp",
    "full",
    "gather",
    "getitem",
    "grad",
    "greater",
    "greater_equal",
    "input",
    "less",
    "less_equal",
    "log",
    "log_softmax",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mul",
    "neg",
    "not_equal",
    "one_hot",
    "ones",
    "param",
    "pow",
    "relu",
    "reshape",
    "scatter_add",
    "sigmoid",
    "softmax",
    "sqrt",
    "state",
    "sub",
    "sum",
    "sum_to",
    "tanh",
    "topo_order",
    "trainable_params",
    "transpose",
    "where",
    "zeros",
]
