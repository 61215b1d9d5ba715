"""lowering_census: the per-kernel counts that compare two JAX versions' Triton lowerings (session
24: jax 0.11.2 left a block's edge stores unmasked where jax 0.12 masked them)."""

import dsv41_jax  # noqa: F401  (import order: dsv41_jax before pallas_kernels)
import json

from pallas_kernels import lowering_census as lc


def test_count_sees_masks_and_ignores_the_cache_policy_attribute():
    masked = ("%1 = tt.load %0, %m : tensor<8x!tt.ptr<f32>>\n"
              "tt.store %0, %1, %m : tensor<8x!tt.ptr<f32>>\n")
    plain = ("%1 = tt.load %0 {cachePolicy = #tt.cache_policy<evict_first>} : tensor<8x!tt.ptr<f32>>\n"
             "tt.store %0, %1 : tensor<8x!tt.ptr<f32>>\n")
    a, b = lc.count(masked), lc.count(plain)
    assert a["masked_loads"] == 1 and a["masked_stores"] == 1
    assert b["masked_loads"] == 0 and b["masked_stores"] == 0 and b["attrs"] == {}
    assert a["ops"] == b["ops"] == {"tt.load": 1, "tt.store": 1}


def test_census_of_a_kernel_and_the_comparison(tmp_path, capsys):
    """The route kernel's census at 4 rows: its stores counted; a census compared with
    itself has no differences, and with a copy whose stores lost their mask (what jax 0.11.2 did to
    the old kernel) the CLI names the kernel and the field and exits 1."""
    doc = lc.census(cases=(("route", 4),))
    (name,) = doc["kernels"]
    k = doc["kernels"][name]
    # 2 x top-6 scalar stores (weights, indices), none masked: every address is in bounds
    assert name == "route/4/moe_route_select" and k["ops"]["tt.store"] == 12 and k["masked_stores"] == 0
    assert k["warps"] == 1
    assert lc.compare(doc, doc) == []
    other = json.loads(json.dumps(doc))
    other["jax"] = "0.11.2"
    other["kernels"][name]["masked_stores"] = k["masked_stores"] + 2
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc))
    b.write_text(json.dumps(other))
    assert lc.main(["--compare", str(a), str(a)]) == 0
    assert lc.main(["--compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "1 differences" in out and f"{name}: masked_stores" in out
