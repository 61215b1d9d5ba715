"""The drafter objects (dsv41_jax/drafters.py): the registry, the errors, and that they work as the
static argument of the speculative programs (equal drafters are one jit cache entry, different ones
two). Their behaviour inside generation is covered by tests/test_speculative.py (DSpark) and
tests/test_speculative_mtp.py (MTP)."""

import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.drafters import DRAFTERS, DSparkDrafter, MTPDrafter, get_drafter


def test_registry_and_errors():
    assert list(DRAFTERS) == ["dspark", "mtp"]  # the order "auto" tries them in
    assert get_drafter("mtp") is DRAFTERS["mtp"] and get_drafter("mtp").needs_next_tokens
    assert not get_drafter("dspark").needs_next_tokens
    with pytest.raises(ValueError, match="drafter must be auto, dspark or mtp, got 'eagle'"):
        get_drafter("eagle")


def test_static_argument_identity():
    assert DSparkDrafter() == DSparkDrafter() and hash(DSparkDrafter()) == hash(DSparkDrafter())
    assert DSparkDrafter() != MTPDrafter()
    traced = []

    def f(x, *, drafter):
        traced.append(drafter.name)
        return x + 1

    g = jax.jit(f, static_argnames=("drafter",))
    x = jnp.ones(3)
    g(x, drafter=DSparkDrafter())
    g(x, drafter=DSparkDrafter())  # a new, equal object: no retrace
    g(x, drafter=MTPDrafter())
    assert traced == ["dspark", "mtp"]
