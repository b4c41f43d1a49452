"""The backward pass: the graph walked once in reverse topological order, gradients summed
per node (``Tensor.backward`` and ``grad`` call it), and the course's ``find_topo_sort``."""

from __future__ import annotations

from . import backend_ndarray as nd
from . import ops
from .autograd import Tensor, Value
from .errors import ArgumentTypeError, GradientError
from .grad_mode import _grad_mode


def _reverse_topo_order(root: Value) -> list[Value]:
    """Nodes that require grad, each after every node that uses it (iterative DFS, so deep
    graphs do not hit Python's recursion limit)."""
    order: list[Value] = []
    visited: set[int] = set()
    stack: list[tuple[Value, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        stack.extend((x, False) for x in node.inputs if x.requires_grad and id(x) not in visited)
    order.reverse()
    return order


def find_topo_sort(node_list: list[Value]) -> list[Value]:
    """Every node the nodes of ``node_list`` depend on, each after all of its inputs, in the
    order a depth-first post-order walk visits them (the needle course's function; needle's
    own backward walks only the nodes that require grad)."""
    order: list[Value] = []
    visited: set[int] = set()
    for root in node_list:
        stack: list[tuple[Value, int]] = [(root, 0)]  # (node, next input to visit)
        while stack:
            node, k = stack.pop()
            if k == 0 and id(node) in visited:
                continue
            if k < len(node.inputs):
                stack.append((node, k + 1))
                if id(node.inputs[k]) not in visited:
                    stack.append((node.inputs[k], 0))
                continue
            if id(node) not in visited:
                visited.add(id(node))
                order.append(node)
    return order


def _backward_pass(output: Tensor, out_grad: Tensor, create_graph: bool,
                   stop_at: frozenset[int] = frozenset()) -> list[tuple[Value, Value]]:
    """(node, gradient) for each leaf requiring grad that ``output`` depends on, and for each
    node whose id is in ``stop_at`` (the gradient does not flow past those)."""
    grads: dict[int, Value] = {id(output): ops.match_input(out_grad, output)}
    found = []
    with _grad_mode(create_graph):
        for node in _reverse_topo_order(output):
            grad = grads.pop(id(node), None)
            if grad is None:
                continue
            if node.is_leaf() or id(node) in stop_at:
                found.append((node, grad))
                continue
            for inp, g in zip(node.inputs, node.op.gradient_as_tuple(grad, node)):
                if g is None or not inp.requires_grad:
                    continue
                if isinstance(inp, Tensor):
                    g = ops.match_input(g, inp)
                prev = grads.get(id(inp))
                grads[id(inp)] = g if prev is None else prev + g
    return found


def grad(output: Tensor, inputs: list[Tensor], out_grad: Tensor | None = None,
         create_graph: bool = False) -> list[Tensor | None]:
    """d(output)/d(input) · out_grad for each of ``inputs`` (leaves or intermediate tensors),
    leaving every ``.grad`` untouched; None for an input ``output`` does not depend on.

    With ``create_graph=True`` the results are graphs themselves: differentiate them again
    for higher-order derivatives.
    """
    if not isinstance(output, Tensor):
        raise ArgumentTypeError(f"grad: output must be a Tensor, got {type(output).__name__}")
    if not isinstance(inputs, (list, tuple)) or not all(isinstance(x, Tensor) for x in inputs):
        raise ArgumentTypeError("grad: inputs must be a list of Tensors, got "
                                f"{inputs!r:.80}")
    if not output.requires_grad:
        raise GradientError("grad() of a tensor that does not require grad")
    if out_grad is None:
        out_grad = Tensor(nd.ones(output.shape, dtype=output.dtype, device=output.device),
                          requires_grad=False)
    found = {id(node): g for node, g in _backward_pass(
        output, output._other(out_grad), create_graph, frozenset(id(x) for x in inputs))}
    return [found.get(id(x)) for x in inputs]
