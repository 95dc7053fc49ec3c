"""The top-k delta codec and error feedback (`speedtronic.distributed.compression`), as properties
over random deltas drawn by hypothesis: decoding an encoding keeps each chunk's largest entries
within the quantisation error; every change a hostile peer could make to a top-k delta is refused
with one line naming the file and the tensor; real files whose header claims more bytes than they
hold are refused before their body is read; and with error feedback the sum of what was sent is the
sum intended less the last residual, for every lossy encoding."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from speedtronic.distributed.compression import (
    ENCODINGS,
    TOPK_CODE,
    TOPK_INDEX,
    TOPK_PARTS,
    TOPK_SCALE,
    TopK,
    decode_topk,
    decode_wire,
    encode_topk,
    encode_wire,
    load_topk_delta,
    send_with_feedback,
    topk_header_fits,
    topk_sections,
)
from speedtronic.distributed.tensors import (
    DeltaRejected,
    delta_header,
    load_safetensors,
    save_safetensors,
)

WHERE = "nodes/n1/delta_40.safetensors"
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def deltas(draw, max_numel: int = 3000) -> dict[str, torch.Tensor]:
    "One or two float32 tensors of random shapes, values gaussian with random scale and ties."
    out = {}
    for key in ("blocks.0.w", "norm")[: draw(st.integers(1, 2))]:
        shape = tuple(draw(st.lists(st.integers(1, 60), min_size=0, max_size=2)))
        numel = 1
        for n in shape:
            numel *= n
        if numel > max_numel:
            shape = (max_numel,)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        values = torch.randn(shape, generator=g) * draw(st.sampled_from([1e-6, 1e-2, 1.0, 300.0]))
        if draw(st.booleans()):  # ties and exact zeros: rounded to a grid
            values = torch.round(values / values.abs().max().clamp_min(1e-30) * 3)
        out[key] = values
    return out


specs = st.builds(
    TopK,
    density=st.sampled_from([0.01, 0.03, 0.05, 0.2, 0.5, 1.0]),
    bits=st.sampled_from([2, 4]),
    chunk=st.sampled_from([1, 3, 64, 500, 4096]),
)


def shapes_of(delta) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in delta.items()}


def sections(wire, header, shapes) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    "Each tensor's (offsets, chunk steps) in the delta's flat parts; a tied one's are its source's."
    declared = topk_header_fits(header, shapes)
    where = topk_sections(declared.spec, declared.encoded)
    where.update({alias: where[k] for alias, k in declared.tied.items()})
    return {
        k: (wire[TOPK_INDEX][e].long(), wire[TOPK_SCALE][s].float()) for k, (e, s) in where.items()
    }


@FAST
@given(deltas(), specs)
def test_decoding_an_encoding_keeps_each_chunks_largest_entries_within_the_quantisation_error(
    delta, spec
):
    wire, header = encode_topk(delta, spec)
    assert set(wire) == set(TOPK_PARTS) and wire[TOPK_INDEX].dtype == spec.offset_dtype
    dense = decode_topk(wire, header, shapes_of(delta), WHERE)
    parts = sections(wire, header, shapes_of(delta))
    levels = 2 ** (spec.bits - 1)
    for k, v in delta.items():
        flat, got = v.reshape(-1), dense[k].reshape(-1)
        assert got.shape == flat.shape and dense[k].shape == v.shape
        offsets, steps = parts[k]
        sent = torch.zeros(flat.numel(), dtype=torch.bool)
        at = 0
        for c, kept in enumerate(spec.counts(flat.numel())):
            start = c * spec.chunk
            chunk = flat[start : start + spec.chunk]
            mine = offsets[at : at + kept] + start
            at += kept
            sent[mine] = True
            assert kept == spec.kept(chunk.numel()) and mine.unique().numel() == kept
            left = torch.ones(chunk.numel(), dtype=torch.bool)
            left[mine - start] = False
            if left.any():  # every kept magnitude is at least every one left out
                assert flat[mine].abs().min() >= chunk[left].abs().max()
            step = float(steps[c])  # the chunk's largest / levels, in bfloat16
            exact = float(flat[mine].abs().max()) / levels
            assert abs(step - exact) <= exact * 2**-8
            err = (got[mine] - flat[mine]).abs()
            bound = torch.maximum(torch.full_like(err, step / 2), step - flat[mine].abs())
            top = levels * abs(exact - step)  # the largest, when the step was rounded down
            assert bool(
                (err <= torch.maximum(bound, torch.full_like(err, top)) + 1e-6 * step).all()
            ), (
                k,
                c,
                err,
                bound,
            )
            nonzero = flat[mine] != 0
            assert torch.equal(got[mine][nonzero].sign(), flat[mine][nonzero].sign())
        assert at == offsets.numel()
        assert not got[~sent].any()  # nothing but the kept entries


def _mutations(wire, header, delta, spec, draw):
    """Each change `draw` makes to a top-k delta: (name, tensors, header, shapes, reason, words,
    what the line names)."""
    shapes = shapes_of(delta)
    declared = topk_header_fits(header, shapes)
    k, (e, s) = next(iter(topk_sections(spec, declared.encoded).items()))
    n = delta[k].numel()
    counts = spec.counts(n)
    idx, code, scale = (wire[p] for p in TOPK_PARTS)
    i = draw(st.integers(0, e.stop - e.start - 1))
    chunk = next(c for c in range(len(counts)) if sum(counts[: c + 1]) > i)
    length = min(spec.chunk, n - chunk * spec.chunk)

    def with_part(part, value):
        return {**wire, part: value}

    info = torch.iinfo(spec.offset_dtype)
    outside = [v for v in (length, length + 7, info.max, -1, info.min) if v >= length or v < 0]
    outside = [v for v in outside if info.min <= v <= info.max]
    if outside:  # none when a full chunk of 256 has uint8 offsets: every byte is in range
        bad = draw(st.sampled_from(outside))
        yield (
            "out of range",
            with_part(TOPK_INDEX, idx.clone().index_fill_(0, torch.tensor(e.start + i), bad)),
            header,
            shapes,
            "shape",
            f"has offset {bad} in chunk {chunk}",
            k,
        )
    first = sum(counts[:chunk])
    if counts[chunk] > 1:
        j = first + (i - first + 1) % counts[chunk]
        dup = idx.clone()
        dup[e.start + j] = idx[e.start + i]
        yield (
            "repeated",
            with_part(TOPK_INDEX, dup),
            header,
            shapes,
            "shape",
            "repeats in chunk",
            k,
        )
    extra = draw(st.integers(1, 50))
    more = dict(with_part(TOPK_INDEX, torch.cat([idx, idx[:1].repeat(extra)])))
    more_header = {**header, "topk_entries": str(int(header["topk_entries"]) + extra)}
    yield (
        "denser",
        more,
        more_header,
        shapes,
        "shape",
        f"of shape ({idx.numel() + extra},); density",
        TOPK_INDEX,
    )
    yield (
        "claims more",
        wire,
        {**header, "topk_entries": str(int(header["topk_entries"]) + extra)},
        shapes,
        "header",
        "the tensors hold",
        "topk_entries",
    )
    bad_scale = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    filled = scale.clone()
    filled[s] = bad_scale
    yield (
        "non-finite scale",
        with_part(TOPK_SCALE, filled),
        header,
        shapes,
        "not_finite",
        "NaN or infinite scales",
        k,
    )
    negative = scale.clone()
    negative[s.start + chunk] = -draw(st.floats(1e-30, 1e30))
    yield (
        "negative scale",
        with_part(TOPK_SCALE, negative),
        header,
        shapes,
        "dtype",
        "negative",
        k,
    )
    yield (
        "float32 scales",
        with_part(TOPK_SCALE, scale.float()),
        header,
        shapes,
        "dtype",
        "needs torch.bfloat16",
        TOPK_SCALE,
    )
    spare = idx.numel() * spec.bits % 8
    if spare:
        past = code.clone()
        past[-1] |= 1 << draw(st.integers(spare, 7))
        yield (
            "code past the width",
            with_part(TOPK_CODE, past),
            header,
            shapes,
            "dtype",
            "codes outside the bit width",
            TOPK_CODE,
        )
    yield (
        "code bytes",
        with_part(TOPK_CODE, torch.cat([code, code[:1].repeat(draw(st.integers(1, 9)))])),
        header,
        shapes,
        "shape",
        "needs torch.uint8 of shape",
        TOPK_CODE,
    )
    other = {**shapes, k: (n + draw(st.integers(1, 40)),)}
    yield "model's shape differs", wire, header, other, "shape", "was encoded from shape", k
    part = draw(st.sampled_from(TOPK_PARTS))
    missing = {p: t for p, t in wire.items() if p != part}
    yield "a part missing", missing, header, shapes, "keys", "missing", part
    yield (
        "wrong dtype",
        with_part(
            TOPK_INDEX, idx.to(draw(st.sampled_from([torch.int32, torch.int64, torch.float32])))
        ),
        header,
        shapes,
        "dtype",
        f"needs {spec.offset_dtype} of shape",
        TOPK_INDEX,
    )
    yield (
        "tied to itself",
        wire,
        {**header, "topk_tied": json.dumps({k: k})},
        shapes,
        "header",
        "must map tensors not encoded to encoded tensors",
        "topk_tied",
    )
    yield (
        "header bits",
        wire,
        {**header, "topk_bits": draw(st.sampled_from(["1", "3", "8", "two", ""]))},
        shapes,
        "header",
        "topk_bits=",
        "topk_bits",
    )
    yield (
        "header density",
        wire,
        {**header, "topk_density": draw(st.sampled_from(["0", "-0.03", "1.5", "nan", "inf"]))},
        shapes,
        "header",
        "topk_density=",
        "topk_density",
    )


@FAST
@given(deltas(), specs, st.data())
def test_every_change_a_hostile_peer_could_make_is_refused_with_one_line(delta, spec, data):
    wire, header = encode_topk(delta, spec)
    for name, tensors, hdr, shapes, reason, words, names in _mutations(
        wire, header, delta, spec, data.draw
    ):
        with pytest.raises(DeltaRejected) as e:
            decode_topk(tensors, hdr, shapes, WHERE)
        line = str(e.value)
        assert (e.value.reason, line.startswith(f"{WHERE}: "), "\n" in line) == (
            reason,
            True,
            False,
        ), (name, line)
        assert words in line and names in line, (name, line)


def test_a_master_with_a_lower_density_refuses_a_denser_delta():
    delta = {"w": torch.randn(4096)}
    wire, header = encode_topk(delta, TopK(0.05, 2, 4096))
    with pytest.raises(DeltaRejected, match=r"header topk_density='0.05' must be in \(0, 0.03\]"):
        decode_topk(wire, header, {"w": (4096,)}, WHERE, max_density=0.03)


def _delta_file(tmp: Path, delta, spec) -> Path:
    wire, header = encode_topk(delta, spec)
    meta = delta_header(
        node_id="n1",
        local_step=40,
        base_outer_step=1,
        inner_steps=20,
        encoding="topk",
        extra=header,
    )
    return save_safetensors(wire, tmp / "delta_40.safetensors", meta)


def _rewrite_header(path: Path, change) -> None:
    "Rewrite the JSON header of the safetensors file at `path` with `change(header)`, body kept."
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_a_file_is_decoded_as_its_tensors_are(tmp_path):
    emb = torch.randn(64, 48)
    delta = {"emb": emb, "emb_copy": emb.clone(), "norm": torch.randn(48)}  # tied: stored once
    spec = TopK(0.03, 2, 512)
    path = _delta_file(tmp_path, delta, spec)
    dense, header = load_topk_delta(path, shapes_of(delta), WHERE, max_density=0.03)
    wire, wire_header = encode_topk(delta, spec)
    expected = decode_topk(wire, wire_header, shapes_of(delta))
    assert all(torch.equal(dense[k], expected[k]) for k in delta)
    assert (header["node_id"], header["topk_entries"]) == ("n1", wire_header["topk_entries"])
    assert json.loads(header["topk_tied"]) == {"emb_copy": "emb"}  # the tied tensor: sent once
    assert set(load_safetensors(path)) == set(TOPK_PARTS)


@pytest.mark.parametrize(
    "damage, words",
    [
        ("truncate", "a truncated or padded file"),
        ("claim more data", "needs"),
        ("length field", "its header length field says"),
        ("entries", "header topk_entries="),
    ],
)
def test_a_file_claiming_more_than_it_holds_is_refused(tmp_path, damage, words):
    delta = {"w": torch.randn(3000), "b": torch.randn(7)}
    path = _delta_file(tmp_path, delta, TopK(0.03, 4, 1000))
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-5])
    elif damage == "claim more data":  # one part's offsets span more bytes than its shape holds
        _rewrite_header(
            path,
            lambda h: h[TOPK_SCALE]["data_offsets"].__setitem__(
                1, h[TOPK_SCALE]["data_offsets"][1] + 4096
            ),
        )
    elif damage == "length field":
        data = path.read_bytes()
        path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    else:
        _rewrite_header(path, lambda h: h["__metadata__"].update(topk_entries="100000"))
    with pytest.raises(DeltaRejected) as e:
        load_topk_delta(path, shapes_of(delta), WHERE)
    assert words in str(e.value) and str(e.value).startswith(WHERE) and "\n" not in str(e.value)
    assert e.value.reason == ("header" if damage == "entries" else "unreadable")


def _one_step(intended: torch.Tensor, encoding: str) -> torch.Tensor:
    "What one encoding of `intended` may lose per entry: bfloat16 2**-8 of it, int8 half a step."
    if encoding == "bfloat16":
        return intended.abs() * 2**-8
    rows = intended.reshape(intended.shape[0] if intended.ndim else 1, -1)
    return (rows.abs().amax(dim=1, keepdim=True) / 127 / 2).expand_as(rows).reshape(intended.shape)


@FAST
@given(deltas(max_numel=1500), st.sampled_from(ENCODINGS[1:]), st.integers(2, 6))
def test_with_feedback_the_sum_sent_is_the_sum_intended_less_the_last_residual(
    delta, encoding, rounds
):
    spec, shapes = TopK(0.03, 2, 256), shapes_of(delta)
    sent = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    intended = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    residual = None
    for r in range(rounds):
        this = {k: v * (1 + 0.25 * r) for k, v in delta.items()}
        meant = {k: v + (0 if residual is None else residual[k]) for k, v in this.items()}
        tensors, header, residual = send_with_feedback(this, residual, encoding, spec)
        for k, v in decode_wire(tensors, header, shapes, WHERE).items():
            sent[k] += v.double()
            intended[k] += this[k].double()
            if encoding != "topk":  # bounded: what one encoding of what was meant loses
                assert bool((residual[k].abs() <= _one_step(meant[k], encoding) * 1.001).all())
    for k in delta:
        gap = (sent[k] + residual[k].double() - intended[k]).abs().max()
        assert gap <= 1e-5 * (intended[k].abs().max() + 1e-30), (encoding, k, float(gap))


def test_unknown_encodings_and_unchecked_dense_deltas_are_refused():
    with pytest.raises(ValueError, match="unknown delta encoding 'fp8'"):
        encode_wire({"w": torch.ones(3)}, "fp8")
    wire, header = encode_wire({"w": torch.ones(3)}, "bfloat16")
    with pytest.raises(
        DeltaRejected, match=rf"^{WHERE}: w has shape \(3,\), the global model has \(4,\)$"
    ):
        decode_wire(wire, header, {"w": (4,)}, WHERE)
