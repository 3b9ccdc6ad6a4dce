"""Convolutions rewritten into XLA:CPU's canonical order compute the same values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jdp._conv_layout import evaluate_canonical


def with_canonical_convolutions(fn):
    """``fn`` traced once and evaluated with its convolutions canonical (as exact mode does)."""

    def rewritten(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        return jax.tree.unflatten(
            jax.tree.structure(shape), evaluate_canonical(closed, jax.tree.leaves(args))
        )

    return rewritten


CANONICAL_2D = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))

CASES = {
    "NHWC": (("NHWC", "HWIO", "NHWC"), (1, 1), (1, 1), 1),
    "NCHW strided": (("NCHW", "OIHW", "NCHW"), (2, 2), (1, 1), 1),
    "mixed, dilated": (("NHWC", "OIHW", "NCHW"), (1, 1), (2, 2), 1),
    "grouped": (("NHWC", "HWIO", "NHWC"), (2, 1), (1, 1), 2),
}


def convolutions(fn, *args):
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [
        e.params["dimension_numbers"] for e in eqns if e.primitive is lax.conv_general_dilated_p
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_equal_the_original_and_every_convolution_is_canonical(case):
    specs, strides, dilation, groups = CASES[case]
    r = np.random.RandomState(0)
    lhs_shape = {"NHWC": (2, 9, 9, 4), "NCHW": (2, 4, 9, 9)}[specs[0]]
    rhs_shape = {"HWIO": (3, 3, 4 // groups, 6), "OIHW": (6, 4 // groups, 3, 3)}[specs[1]]
    x = jnp.asarray(r.randn(*lhs_shape), jnp.float32)
    w = jnp.asarray(r.randn(*rhs_shape), jnp.float32)

    def loss(x, w):
        y = lax.conv_general_dilated(
            x,
            w,
            strides,
            "SAME",
            rhs_dilation=dilation,
            dimension_numbers=specs,
            feature_group_count=groups,
        )
        return jnp.sum(jnp.tanh(y) ** 2)

    original = jax.grad(loss, argnums=(0, 1))
    rewritten = with_canonical_convolutions(original)
    assert any(d != CANONICAL_2D for d in convolutions(original, x, w))  # something to rewrite
    assert all(d == CANONICAL_2D for d in convolutions(rewritten, x, w))
    # Outside a loop XLA canonicalizes the original the same way: the same bits.
    for a, b in zip(jax.jit(rewritten)(x, w), jax.jit(original)(x, w), strict=True):
        np.testing.assert_array_equal(a, b)


def test_pytrees_and_nested_jits_pass_through():
    @jax.jit
    def inner(x, w):
        return lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )

    def fn(tree):
        return {"y": inner(tree["x"], tree["w"]), "n": tree["n"] + 1}

    tree = {"x": jnp.ones((1, 2, 5, 5)), "w": jnp.ones((3, 2, 3, 3)), "n": jnp.int32(4)}
    out = with_canonical_convolutions(fn)(tree)
    assert all(d == CANONICAL_2D for d in convolutions(with_canonical_convolutions(fn), tree))
    np.testing.assert_array_equal(out["y"], fn(tree)["y"])
    assert int(out["n"]) == 5
