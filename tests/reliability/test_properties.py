"""Property-based tests (hypothesis) for the partition-rule resolver and the data packer."""

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxloom.data as jd
from jaxloom.mesh import MeshConfig, PartitionAxis, auto_partition_rules, match_partition_rules

TOK = jd.load_processor()
AXES = st.sampled_from([{"fsdp": 8}, {"fsdp": 4, "tp": 2}, {"fsdp": 2, "tp": 4}, {"dp": 2, "fsdp": 2, "tp": 2}])
SHAPES = st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32]), min_size=1, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(axes=AXES, shapes=st.lists(SHAPES, min_size=1, max_size=6))
def test_automatic_rules_always_give_valid_specs(axes, shapes):
    """Whatever the shapes, every resolved spec names mesh axes at most once and divides its dim."""
    mesh = MeshConfig.from_axes(**axes).build()
    tree = {f"p{i}": jax.ShapeDtypeStruct(s, np.float32) for i, s in enumerate(shapes)}
    specs = match_partition_rules(auto_partition_rules(tree, mesh, axes=("fsdp", "tp")), tree, mesh=mesh)
    for name, leaf in tree.items():
        spec = specs[name]
        used = [a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))]
        assert len(used) == len(set(used)), (name, spec)
        for dim, entry in zip(leaf.shape, spec, strict=False):
            if entry:
                size = int(np.prod([mesh.shape[a] for a in (entry if isinstance(entry, tuple) else (entry,))]))
                assert dim % size == 0, (name, leaf.shape, spec)


@settings(max_examples=30, deadline=None)
@given(names=st.lists(st.sampled_from(["batch", "length", "embed", "heads", "vocab", "mlp", None]), max_size=4))
def test_partition_axis_specs_only_name_mesh_axes(names):
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    pa = PartitionAxis()
    for kind in ("param", "activation"):
        spec = pa.spec(names, kind=kind, mesh=mesh)
        flat = [a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))]
        assert set(flat) <= set(mesh.axis_names) and len(flat) == len(set(flat))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    docs=st.lists(st.text(alphabet="abcdefgh ijk.", min_size=1, max_size=120), min_size=1, max_size=12),
    length=st.sampled_from([8, 16, 33]),
    rows=st.integers(1, 4),
)
def test_packer_keeps_every_token_in_order_and_segments_apart(docs, length, rows):
    """Packing then concatenating the real tokens gives back the token stream, segment ids restart
    per row and rise by one per document, positions restart with each document."""
    records = [{"text": d} for d in docs]
    loader = jd.DataLoader(
        records,
        TOK,
        jd.DataConfig(max_sequence_length=length, batch_size=rows, shuffle=False, num_epochs=1, prefetch=0),
    )
    stream = []
    for batch in loader:
        for r in range(rows):
            seg, pos, ids = batch["segment_ids"][r], batch["positions"][r], batch["input_ids"][r]
            real = seg > 0
            assert (np.diff(seg[real]) >= 0).all() and (seg[real][:1] == 1).all()
            assert not real[np.argmin(real) :].any() if not real.all() else True  # padding only at the end
            for s in np.unique(seg[real]):
                p = pos[seg == s]
                assert (np.diff(p) == 1).all()
            stream.extend(ids[real].tolist())
    expected = []
    for d in docs:
        expected += [TOK.bos_token_id, *TOK.encode(d, add_special_tokens=False), TOK.eos_token_id]
    assert stream == expected
