"""The numpy casts of `ckptflow.formats.casts` against torch's own CPU casts, bit for bit: every 16-bit
pattern for the widening casts, and for the narrowing ones several million float32 patterns (every
sign and exponent with the rounding boundaries of both targets, NaNs with many payloads, infinities,
subnormals, and random bits). Every test runs twice: with the compiled float32 -> bfloat16 / float16
casts (`ckptflow.formats._casts`) and with numpy alone, as an install without a C compiler runs."""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest
import torch

from ckptflow.formats import casts

# torch's float32 -> bfloat16 NaN is 0xFFFF in its AVX2 / AVX-512 kernels, 0x7FC0 in the scalar
# fallback; ckptflow writes the former. Elsewhere only the NaN lanes are left out of the comparison.
X86_KERNELS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
COMPILED = casts.native


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "compiled" and COMPILED is None:
        pytest.skip("ckptflow.formats._casts was not built (test_the_install_built_the_compiled_casts says why)")
    monkeypatch.setattr(casts, "native", COMPILED if request.param == "compiled" else None)
    return request.param


def ours(src: str, out: str, bits: np.ndarray, out_bits: type) -> np.ndarray:
    result = np.empty(bits.size, dtype=out_bits)
    casts.cast_into(result, out, bits, src)
    return result


def fp32_patterns() -> np.ndarray:
    """Float32 bit patterns: for every sign and exponent, the neighbourhood of every rounding position
    (ties with an odd and an even kept part, one below and one above, all-zero and all-one tails) under
    three upper parts (zero, all ones so the carry runs into the exponent, random); then NaNs, and
    four million random patterns."""
    rng = np.random.default_rng(20240917)
    sign_exp = (np.arange(512, dtype=np.uint32) << 23)  # sign and exponent, all 512
    tails = []
    for p in range(1, 23):  # bits below p are dropped: 16 for bfloat16, 13 for float16, more in subnormals
        half = 1 << (p - 1)
        for low in (0, 1, half - 1, half, half + 1, (1 << p) - 1):
            for parity in (0, 1):
                for upper in (0, (1 << 23) - 1, int(rng.integers(0, 1 << 23))):
                    tails.append((upper & ~((1 << (p + 1)) - 1)) | parity << p | low)
    mantissas = np.unique(np.array(tails, dtype=np.uint32) & 0x7FFFFF)
    grid = (sign_exp[:, None] | mantissas[None, :]).reshape(-1)
    nan_payloads = np.concatenate([1 << np.arange(23, dtype=np.uint32), (1 << np.arange(1, 24, dtype=np.uint32)) - 1,
                                   rng.integers(1, 1 << 23, 4096, dtype=np.uint32)])
    nans = np.concatenate([0x7F800000 | nan_payloads, 0xFF800000 | nan_payloads])
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 1, 0x807FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
                        0x477FE000, 0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x387FE000, 0x387FF000],
                       dtype=np.uint32)
    randoms = rng.integers(0, 1 << 32, 4_000_000, dtype=np.uint32)
    return np.concatenate([special, grid, nans, randoms])


@pytest.fixture(scope="module")
def fp32_bits() -> np.ndarray:
    return fp32_patterns()


def all_16bit() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_bf16_to_fp32_every_pattern() -> None:
    bits = all_16bit()
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32).view(torch.int32).numpy()
    assert np.array_equal(ours("bfloat16", "float32", bits, np.uint32), want.view(np.uint32))


def test_fp16_to_fp32_every_pattern() -> None:
    bits = all_16bit()
    want = torch.from_numpy(bits.view(np.int16)).view(torch.float16).to(torch.float32).view(torch.int32).numpy()
    got = ours("float16", "float32", bits, np.uint32)
    assert np.array_equal(got, want.view(np.uint32))
    nan = (bits & 0x7C00 == 0x7C00) & (bits & 0x3FF != 0)
    assert nan.sum() == 2046 and (got[nan] & 0x7FC00000 == 0x7FC00000).all()  # quiet, sign and payload kept


def test_fp16_to_fp32_nan_in_torchs_scalar_tail() -> None:
    """Torch widens the last `numel % 8` elements one by one, and there every NaN becomes 0x7FFFFFFF;
    ckptflow gives every element what torch's vectorized kernel gives (documented in `casts`)."""
    bits = np.full(9, 0xFE01, dtype=np.uint16)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.float16).to(torch.float32).view(torch.int32).numpy()
    assert [hex(x) for x in want.view(np.uint32)[[0, 8]]] == ["0xffc02000", "0x7fffffff"]
    assert (ours("float16", "float32", bits, np.uint32) == 0xFFC02000).all()


def test_bf16_to_fp16_every_pattern() -> None:
    bits = np.concatenate([all_16bit(), all_16bit()[::-1][:1001]])  # past a block edge
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float16).view(torch.int16).numpy()
    assert np.array_equal(ours("bfloat16", "float16", bits, np.uint16), want.view(np.uint16))


def test_fp16_to_bf16_every_pattern() -> None:
    bits = np.concatenate([all_16bit(), all_16bit()[::-1][:1001]])
    want = torch.from_numpy(bits.view(np.int16)).view(torch.float16).to(torch.bfloat16).view(torch.int16).numpy()
    got = ours("float16", "bfloat16", bits, np.uint16)
    assert np.array_equal(got, want.view(np.uint16))
    nan = (bits & 0x7C00 == 0x7C00) & (bits & 0x3FF != 0)
    assert nan.sum() > 2046 and (got[nan] == 0x7FC0).all()


def test_fp32_to_bf16_matches_torch(fp32_bits: np.ndarray) -> None:
    want = torch.from_numpy(fp32_bits.view(np.int32)).view(torch.float32).to(torch.bfloat16).view(torch.int16)
    want = want.numpy().view(np.uint16)
    got = ours("float32", "bfloat16", fp32_bits, np.uint16)
    nan = np.isnan(fp32_bits.view(np.float32))
    assert nan.sum() > 10_000 and (got[nan] == 0xFFFF).all()
    keep = slice(None) if X86_KERNELS else ~nan
    assert np.array_equal(got[keep], want[keep]), np.flatnonzero(got[keep] != want[keep])[:10]


def test_fp32_to_fp16_matches_torch(fp32_bits: np.ndarray) -> None:
    want = torch.from_numpy(fp32_bits.view(np.int32)).view(torch.float32).to(torch.float16).view(torch.int16)
    want = want.numpy().view(np.uint16)
    got = ours("float32", "float16", fp32_bits, np.uint16)
    differ = np.flatnonzero(got != want)
    assert differ.size == 0, [(hex(fp32_bits[i]), hex(got[i]), hex(want[i])) for i in differ[:10]]


@pytest.mark.parametrize("bits, want", [
    (0x3F808000, 0x3F80), (0x3F818000, 0x3F82), (0x3F808001, 0x3F81), (0x3F807FFF, 0x3F80),  # ties to even
    (0x7F7FFFFF, 0x7F80), (0xFF7F8000, 0xFF80), (0x7F7F7FFF, 0x7F7F),  # past the largest bfloat16: infinity
    (0x00008000, 0x0000), (0x00018000, 0x0002), (0x807FFFFF, 0x8080),  # subnormals round like the rest
    (0x7F800000, 0x7F80), (0xFF800000, 0xFF80),
    (0x7FC00000, 0xFFFF), (0xFF800001, 0xFFFF), (0x7FFFFFFF, 0xFFFF),  # every NaN: 0xFFFF
])
def test_fp32_to_bf16_pinned(bits: int, want: int) -> None:
    assert ours("float32", "bfloat16", np.array([bits], dtype=np.uint32), np.uint16)[0] == want


@pytest.mark.parametrize("bits, want", [
    (0x477FEFFF, 0x7BFF), (0x477FF000, 0x7C00), (0xC77FF000, 0xFC00),  # 65520 and above: infinity
    (0x33000000, 0x0000), (0x33000001, 0x0001), (0x33C00000, 0x0002),  # subnormal ties to even
    (0x7F800001, 0x7E00), (0xFF812345, 0xFE09), (0x7FA00000, 0x7F00), (0x7FFFFFFF, 0x7FFF),  # NaN: quiet bit set
])
def test_fp32_to_fp16_pinned(bits: int, want: int) -> None:
    assert ours("float32", "float16", np.array([bits], dtype=np.uint32), np.uint16)[0] == want


def test_block_edges_and_lengths() -> None:
    """NaNs on either side of a block edge, and lengths that are not a multiple of anything."""
    for n in (0, 1, 7, casts.BLOCK - 1, casts.BLOCK, casts.BLOCK + 3, 3 * casts.BLOCK + 5):
        bits = np.random.default_rng(n).integers(0, 1 << 32, n, dtype=np.uint32)
        for i in (casts.BLOCK - 1, casts.BLOCK, n - 1):
            if 0 <= i < n:
                bits[i] = 0xFFC00001
        f = torch.from_numpy(bits.view(np.int32)).view(torch.float32)
        for out, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            want = f.to(dtype).view(torch.int16).numpy().view(np.uint16)
            got = ours("float32", out, bits, np.uint16)
            keep = slice(None) if X86_KERNELS or out == "float16" else ~np.isnan(bits.view(np.float32))
            assert np.array_equal(got[keep], want[keep]), (n, out)


@pytest.mark.parametrize("src, out", [("float64", "float32"), ("float32", "float64"), ("int64", "float32"),
                                      ("int64", "int64"), ("bool", "bool"), ("float32", "float32")])
def test_other_pairs_through_torch_or_copy(src: str, out: str) -> None:
    source = (torch.randn(1000, dtype=torch.float64) * 1000).to(getattr(torch, src))
    raw = source.view(torch.uint8).numpy().tobytes()  # read-only bytes, as a store returns them
    dest = bytearray(1000 * torch.empty(0, dtype=getattr(torch, out)).element_size())
    casts.cast_into(memoryview(dest), out, raw, src)
    assert dest == source.to(getattr(torch, out)).view(torch.uint8).numpy().tobytes()
    assert casts.needs_torch(src, out) == (src != out)


def test_scalar_for_messages() -> None:
    assert casts.scalar(bytes.fromhex("c03f"), "bfloat16") == 1.5
    assert casts.scalar(np.float16(-2.5).tobytes(), "float16") == -2.5
    assert casts.scalar(np.int64(-7).tobytes(), "int64") == -7
    assert casts.scalar(b"\x01", "bool") is True
    assert casts.scalar(b"\x12", "float8_e4m3fn") == "12"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_count_non_finite_agrees_with_torch_on_every_16_bit_pattern(dtype: str) -> None:
    from ckptflow.formats.casts import count_non_finite

    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    values = bits.view(getattr(torch, dtype))
    assert count_non_finite(bits.numpy().tobytes(), dtype) == int((~torch.isfinite(values)).sum())


def test_count_non_finite_float32_and_integers() -> None:
    from ckptflow.formats.casts import count_non_finite

    values = torch.tensor([0.0, -1.5, float("inf"), float("-inf"), float("nan"), 3e38, 1e-45])
    assert count_non_finite(values.numpy().tobytes(), "float32") == 3
    assert count_non_finite(values.double().numpy().tobytes(), "float64") == 3
    assert count_non_finite(torch.arange(10).numpy().tobytes(), "int64") == 0


def test_the_install_built_the_compiled_casts(implementation: str) -> None:
    """Where a C compiler is at hand, `pip install` builds the compiled casts (setup.py makes the
    extension optional, so a failed build would only print a warning and leave the numpy casts)."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: the install keeps the numpy casts")
    assert COMPILED is not None, "ckptflow.formats._casts is missing: run `make install` and read pip's warnings"


def test_the_compiled_casts_refuse_buffers_of_the_wrong_size(implementation: str) -> None:
    if implementation != "compiled":
        pytest.skip("the compiled module's own argument checks")
    for name in ("fp32_to_bf16", "fp32_to_fp16"):
        with pytest.raises(ValueError, match="not half"):
            getattr(COMPILED, name)(bytes(8), bytearray(2))
        with pytest.raises(ValueError, match="whole float32"):
            getattr(COMPILED, name)(bytes(6), bytearray(3))
        with pytest.raises(TypeError):
            getattr(COMPILED, name)(bytes(8), bytes(4))  # a read-only output


def test_strided_and_read_only_sources_cast_alike() -> None:
    """A read-only source (bytes, as a store returns them) and a strided one (numpy only takes these
    through its own path) give the bits a contiguous writable one gives."""
    bits = np.random.default_rng(5).integers(0, 1 << 32, 2 * 1000 + 1, dtype=np.uint32)
    for out, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        contiguous = bits[::2].copy()  # torch casts a strided tensor with its scalar loop (NaN: 0x7FC0)
        want = torch.from_numpy(contiguous.view(np.int32)).view(torch.float32).to(dtype).view(torch.int16).numpy()
        keep = slice(None) if X86_KERNELS or out == "float16" else ~np.isnan(bits[::2].view(np.float32))
        from_bytes = np.empty(1001, dtype=np.uint16)
        casts.cast_into(from_bytes, out, bits[::2].tobytes(), "float32")
        strided = np.empty(2002, dtype=np.uint16)[::2]
        getattr(casts, "fp32_to_bf16" if out == "bfloat16" else "fp32_to_fp16")(bits[::2], strided)
        for got in (from_bytes, strided):
            assert np.array_equal(got[keep], want.view(np.uint16)[keep]), out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_cast_view_reads_float32_bytes_as_torch_casts_them(dtype: str, tmp_path) -> None:
    """`tensorref.cast_view`: the writer's reader turns a float32 range into `dtype` bytes on the way,
    bit for bit as torch's `.to(dtype)` (what DeepSpeed does to its masters after every step)."""
    from ckptflow.formats.torch.tensorref import TensorRef, cast_view, parse_cast
    from ckptflow.formats.torch.writer import SourceReader

    values = torch.cat([torch.randn(1000) * 1e3, torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 65504.0,
                                                               70000.0, 3.0e38])])
    path = tmp_path / "masters.bin"
    path.write_bytes(b"\0" * 64 + values.numpy().tobytes())
    ref = TensorRef(str(path), "0", "float32", (values.numel(),), (1,), 0, values.numel(), 64)
    view = cast_view(ref, dtype)
    assert parse_cast(view.uri) == (dtype, str(path)) and parse_cast(str(path)) is None
    start, end = view.element_range(10, values.numel() - 10)
    out = bytearray(end - start)
    with SourceReader() as reader:
        reader.read_into(view.uri, start, memoryview(out))
    expected = values[10:].to(getattr(torch, dtype))
    assert bytes(out) == expected.view(torch.int16).numpy().tobytes()
    with pytest.raises(ValueError, match="cannot read float32 .* at byte 63 as bfloat16"):
        cast_view(TensorRef(str(path), "0", "float32", (1,), (1,), 0, 1, 63), "bfloat16")
