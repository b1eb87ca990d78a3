"""protocol.codec: tensors survive the wire exactly (or, compressed, closely), and bad messages are typed errors."""

from __future__ import annotations

import pytest
import torch

from protocol import swarmlm_pb2 as pb
from protocol.codec import MAX_NDIM, decode_optional, decode_tensor, encode_optional, encode_tensor
from protocol.errors import BadRequestError

SHAPES = [(), (0,), (5,), (2, 3), (2, 0, 4), (1, 1, 64), (2, 7, 16)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype == torch.int64:
        # both signs and values beyond 32 bits, so a narrowing or sign bug shows
        return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64)
    return (torch.randn(shape, generator=gen) * 10).to(dtype)


def roundtrip(message: pb.Tensor) -> torch.Tensor:
    """Decode after a real serialization, as a peer would receive it."""
    return decode_tensor(pb.Tensor.FromString(message.SerializeToString()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_is_exact(shape, dtype):
    tensor = sample(shape, dtype)
    message = encode_tensor(tensor)
    assert message.compression == pb.NONE
    assert list(message.shape) == list(shape)
    assert message.dtype == str(dtype).removeprefix("torch.")
    decoded = roundtrip(message)
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int16, torch.int8, torch.uint8], ids=str)
def test_roundtrip_other_supported_dtypes(dtype):
    tensor = sample((3, 4), dtype) if dtype.is_floating_point else torch.arange(12, dtype=dtype).reshape(3, 4)
    decoded = roundtrip(encode_tensor(tensor))
    assert decoded.dtype == dtype
    assert torch.equal(decoded, tensor)


def test_non_contiguous_and_grad_tensors_are_encoded_by_value():
    base = torch.randn(4, 6, requires_grad=True)
    view = base.t()[1:, ::2]  # non-contiguous, part of an autograd graph
    decoded = roundtrip(encode_tensor(view))
    assert not decoded.requires_grad
    assert torch.equal(decoded, view.detach())


def test_decoded_tensor_is_writable_and_does_not_alias_the_message():
    message = encode_tensor(torch.zeros(3))
    decoded = decode_tensor(message)
    decoded += 1  # would fail (or corrupt the message) if it viewed the protobuf's immutable bytes
    assert torch.equal(decode_tensor(message), torch.zeros(3))


@pytest.mark.parametrize("shape", [(), (0,), (2, 3, 64)], ids=str)
def test_float16_compression_of_float32_is_close_and_restores_dtype(shape):
    tensor = sample(shape, torch.float32)
    message = encode_tensor(tensor, pb.FLOAT16)
    assert message.compression == pb.FLOAT16
    assert message.dtype == "float32"
    assert len(message.data) == tensor.numel() * 2  # half the bytes of float32
    decoded = roundtrip(message)
    assert decoded.dtype == torch.float32
    assert decoded.shape == tensor.shape
    torch.testing.assert_close(decoded, tensor, rtol=1e-3, atol=1e-3)


def test_float16_compression_of_float16_is_a_no_op():
    tensor = sample((4, 4), torch.float16)
    message = encode_tensor(tensor, pb.FLOAT16)
    assert message.compression == pb.NONE
    assert torch.equal(roundtrip(message), tensor)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.int32, torch.uint8], ids=str)
def test_float16_compression_is_ignored_for_non_floating_tensors(dtype):
    tensor = (
        sample((3, 5), dtype) if dtype in (torch.int64, torch.bool) else torch.arange(15, dtype=dtype).reshape(3, 5)
    )
    message = encode_tensor(tensor, pb.FLOAT16)
    assert message.compression == pb.NONE
    assert message.dtype == str(dtype).removeprefix("torch.")
    decoded = roundtrip(message)
    assert decoded.dtype == dtype
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_float16_compression_keeps_large_values_finite(dtype):
    tensor = torch.tensor([1e5, -3e5, 1.0], dtype=dtype)
    decoded = roundtrip(encode_tensor(tensor, pb.FLOAT16))
    assert torch.isfinite(decoded).all(), decoded


def test_encode_rejects_an_unsupported_dtype():
    with pytest.raises(BadRequestError, match="complex64"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("delta", [-1, 1, -8], ids=["one-short", "one-extra", "one-element-short"])
def test_decode_rejects_wrong_byte_length(delta):
    good = encode_tensor(torch.zeros(2, 4))
    bad = pb.Tensor(shape=good.shape, dtype=good.dtype, data=good.data[:delta] if delta < 0 else good.data + b"\0")
    with pytest.raises(BadRequestError, match=r"needs 32 bytes, got (31|33|24)") as info:
        decode_tensor(bad, "hidden_states")
    assert "hidden_states" in str(info.value)
    assert "[2, 4]" in str(info.value)


def test_decode_rejects_wrong_byte_length_under_compression():
    good = encode_tensor(torch.zeros(2, 4), pb.FLOAT16)
    # 32 bytes is right for float32 but the wire dtype is float16: 16 bytes
    bad = pb.Tensor(shape=[2, 4], dtype="float32", data=b"\0" * 32, compression=pb.FLOAT16)
    assert len(good.data) == 16
    with pytest.raises(BadRequestError, match="needs 16 bytes, got 32"):
        decode_tensor(bad)


def test_decode_rejects_data_for_an_empty_shape():
    with pytest.raises(BadRequestError, match="needs 0 bytes, got 4"):
        decode_tensor(pb.Tensor(shape=[0, 3], dtype="float32", data=b"\0" * 4))


@pytest.mark.parametrize("dtype", ["float8", "torch.float32", "", "complex64"])
def test_decode_rejects_unknown_dtype(dtype):
    with pytest.raises(BadRequestError, match="unknown tensor dtype") as info:
        decode_tensor(pb.Tensor(shape=[1], dtype=dtype, data=b"\0" * 4))
    assert repr(dtype) in str(info.value)


def test_decode_rejects_negative_dimension():
    with pytest.raises(BadRequestError, match=r"negative dimension in shape \[-1, 4\]") as info:
        decode_tensor(pb.Tensor(shape=[-1, 4], dtype="float32", data=b""), "grad_outputs")
    assert "grad_outputs" in str(info.value)


def test_decode_rejects_negative_dimensions_whose_product_matches():
    # (-2) * (-2) = 4 elements = 16 bytes: the byte count alone would not catch it
    with pytest.raises(BadRequestError, match="negative dimension"):
        decode_tensor(pb.Tensor(shape=[-2, -2], dtype="float32", data=b"\0" * 16))


def test_decode_rejects_unknown_compression():
    message = pb.Tensor(shape=[1], dtype="float32", data=b"\0" * 4, compression=7)
    with pytest.raises(BadRequestError, match="unknown compression 7"):
        decode_tensor(message)


def test_optional_helpers():
    assert encode_optional(None) is None
    request = pb.ForwardRequest(hidden_states=encode_tensor(torch.ones(1, 2, 3)))
    assert decode_optional(request, "attention_mask") is None
    assert torch.equal(decode_optional(request, "hidden_states"), torch.ones(1, 2, 3))
    request.attention_mask.CopyFrom(pb.Tensor(shape=[2], dtype="int64", data=b"\0"))
    with pytest.raises(BadRequestError, match="attention_mask"):
        decode_optional(request, "attention_mask")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int64", "int32", "uint8", "bool"])
def test_decode_rejects_float16_compression_of_other_dtypes(dtype):
    """Only float32 and float64 are sent compressed (`wire_form`); 2 bytes per element read as int64 is a bug."""
    message = pb.Tensor(shape=[4], dtype=dtype, data=bytes(8), compression=pb.FLOAT16)
    with pytest.raises(BadRequestError, match=f"FLOAT16 compression applies to float32, float64 tensors, not {dtype}"):
        decode_tensor(message, "x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_accepts_float16_compression_of_float32_and_float64(dtype):
    tensor = torch.tensor([1.5, -2.0], dtype=dtype)
    assert torch.equal(decode_tensor(encode_tensor(tensor, pb.FLOAT16)), tensor)


def test_decode_rejects_too_many_dimensions():
    message = pb.Tensor(shape=[1] * (MAX_NDIM + 1), dtype="float32", data=bytes(4))
    with pytest.raises(BadRequestError, match=f"{MAX_NDIM + 1} dimensions, at most {MAX_NDIM}"):
        decode_tensor(message, "x")
    assert decode_tensor(pb.Tensor(shape=[1] * MAX_NDIM, dtype="float32", data=bytes(4))).shape == (1,) * MAX_NDIM


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [2**63 - 1, 0], [0] + [2**40] * 7, [2**32, 2**32]])
def test_decode_rejects_huge_shapes_without_overflow(shape):
    """Zero elements or not, dimensions whose product overflows int64 strides are refused, typed."""
    message = pb.Tensor(shape=shape, dtype="float32")
    with pytest.raises(BadRequestError, match=r"too large to be a tensor|needs"):
        decode_tensor(message, "x")


def test_decode_of_an_empty_shape_with_a_large_dimension():
    assert decode_tensor(pb.Tensor(shape=[0, 1 << 20], dtype="float32")).shape == (0, 1 << 20)


@pytest.mark.parametrize("shape", [(5,), (2, 7, 16), (1, 3, 200), (0,), ()], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bfloat16_and_int8_compression_restore_the_dtype_within_their_precision(shape, dtype):
    tensor = sample(shape, torch.float32).to(dtype)
    tensor.view(-1)[:1] *= 100  # an outlier: INT8's error is per block, so it costs only its own block
    half = roundtrip(encode_tensor(tensor, pb.BFLOAT16))
    assert half.dtype == dtype and torch.equal(half, tensor.to(torch.bfloat16).to(dtype))
    message = encode_tensor(tensor, pb.INT8)
    assert message.compression == pb.INT8 and len(message.data) == -(-tensor.numel() // 64) * 68
    got = roundtrip(message)
    assert got.dtype == dtype and got.shape == tensor.shape
    flat, back = tensor.reshape(-1).double(), got.reshape(-1).double()
    for start in range(0, flat.numel(), 64):  # within half a step of its block's scale
        block = slice(start, start + 64)
        step = flat[block].abs().max() / 127
        assert bool(((flat[block] - back[block]).abs() <= step / 2 + 1e-6 * step).all())


def test_int8_compression_in_a_payload_reads_unaligned_scales():
    from protocol.packing import Packer, unpack

    tensor = sample((3, 1000), torch.float32)  # 47 blocks of codes: the scales start at an odd multiple of 4
    packer = Packer()
    message = pb.ForwardRequest(hidden_states=packer.tensor(tensor, pb.INT8))
    received = unpack(pb.ForwardRequest, packer.pack(message).SerializeToString())
    got = decode_tensor(received.message.hidden_states, "hidden_states", received.payload)
    torch.testing.assert_close(got, tensor, atol=float(tensor.abs().max()) / 127, rtol=0)


def test_int8_compression_sends_a_non_finite_tensor_as_it_is():
    tensor = torch.tensor([1.0, float("nan"), float("inf")])
    message = encode_tensor(tensor, pb.INT8)
    assert message.compression == pb.NONE
    got = roundtrip(message)
    assert got[0] == 1.0 and got[1].isnan() and got[2].isinf()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_decode_rejects_int8_scales_that_are_not_finite_and_non_negative(scale):
    data = bytes(64) + torch.tensor([scale], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    with pytest.raises(BadRequestError, match="x: INT8 compression with a scale"):
        decode_tensor(pb.Tensor(shape=[10], dtype="float32", data=data, compression=pb.INT8), "x")


@pytest.mark.parametrize("compression", [pb.BFLOAT16, pb.INT8])
def test_decode_rejects_other_compressions_of_other_dtypes_and_wrong_lengths(compression):
    with pytest.raises(BadRequestError, match=r"compression applies to .*tensors, not int64"):
        decode_tensor(pb.Tensor(shape=[4], dtype="int64", data=bytes(68), compression=compression), "x")
    message = encode_tensor(torch.ones(100), compression)
    message.data = message.data[:-1]
    with pytest.raises(BadRequestError, match="bytes"):
        decode_tensor(message, "x")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_compression_shrinks_half_precision_too(dtype):
    tensor = sample((2, 7, 64), torch.float32).to(dtype)
    message = encode_tensor(tensor, pb.INT8)
    assert message.compression == pb.INT8 and len(message.data) < tensor.numel() * 2
    got = roundtrip(message)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), tensor.float(), atol=float(tensor.abs().max()) / 100, rtol=0)
    assert encode_tensor(tensor, pb.BFLOAT16).compression == pb.NONE  # nothing to gain
