"""A lying peer, for tests only: a real `swarmlm peer` behind a proxy that corrupts the answers it is told to.

    python tests/helpers/liar.py MODE_FILE peer MODEL --initial-peers ... [more `swarmlm peer` flags]

The peer runs as the `swarmlm` command runs it (`swarm.cli.main`), on a private port; it announces the proxy's
address instead (`--announce-host`, `--transport direct`), so clients reach it only through the proxy. The
proxy passes every call through, and corrupts the answers that MODE_FILE (JSON, read again on every call) names:

    {"lie": "nan", "on": "inference", "from_position": 8}

- lie: honest (the default, also without a file), or one of
    bad_request  refuse with a bad_request error, as if the client's input were wrong;
    shape        one token more than was sent;
    dtype        float16 instead of the dtype computed in;
    nan          a NaN in every row;
    empty        an answer without its tensor (inference: an error-less empty message);
    perturb      noise of `scale` (default 1e-2) times the tensor's std added: still finite, of the shape and
                 dtype asked for, so only a spot check on another peer (client/verify.py) can tell;
    scale        the answer times 1 + `scale`: the same lie for the same answer, so two liars agree (colluders);
    lose         pass the call on, then drop the answer as a lost connection would (UNAVAILABLE): the peer did
                 the work, the client cannot know; with "times": N, only the first N calls
    withhold     do not pass the call on: hold it while MODE_FILE still says so (at most the call's deadline, and
                 with "for_s": S at most S seconds), then answer UNAVAILABLE, as if the request had been lost on
                 its way; the peer never sees it
  and for inference only:
    kind         `opened` where a step result is due;
    position     a cache position one past the truth;
    step_id      another step's id.
- on: forward, backward or inference, or a list of them.
- from_position: inference steps that build on fewer cached tokens are answered honestly, so that the client
  has a history to replay elsewhere (default 0).

Every lie is printed to stdout as "lied: LIE on METHOD". The proxy uses gRPC's threaded API, apart from the
peer's event loop.
"""

from __future__ import annotations

import json
import queue
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __name__ == "__main__":  # run as a script: import this repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc
import torch

from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.packing import Packer, unpack
from protocol.service import ERROR_CODE_KEY, METHODS, SERVICE_NAME

LIES = (
    "honest", "bad_request", "shape", "dtype", "nan", "empty", "perturb", "scale", "kind", "position", "step_id", "lose",
    "withhold",
)  # fmt: skip
TENSOR_FIELD = {"Forward": "hidden_states", "Backward": "grad_inputs"}
_MAX_BYTES = 128 * 1024 * 1024
_REFUSAL = "hidden_states contains NaN or inf"  # what an honest peer says of really bad input


def corrupt(tensor: torch.Tensor, lie: str, scale: float = 1e-2) -> torch.Tensor:
    if lie == "shape":
        return torch.cat([tensor, tensor[:, -1:]], dim=1)
    if lie == "dtype":
        return tensor.to(torch.float32 if tensor.dtype == torch.float16 else torch.float16)
    if lie == "nan":
        tensor = tensor.clone()
        tensor[..., 0] = float("nan")
        return tensor
    if lie == "perturb":
        return tensor + scale * tensor.float().std().to(tensor.dtype) * torch.randn_like(tensor)
    if lie == "scale":  # the same lie for the same answer, whichever peer tells it: colluders agree
        return tensor * (1 + scale)
    return tensor


def replace_tensor(received, field: str, tensor: torch.Tensor) -> bytes:
    """`received`'s answer with `tensor` in `field` and every other field as the peer answered it (a liar that
    changes only the numbers: a Forward's router sums stay)."""
    packer = Packer()
    response = type(received.message)(**{field: packer.tensor(tensor)})
    for descriptor, value in received.message.ListFields():
        if descriptor.name in (field, "payload"):
            continue
        if descriptor.message_type is not None:
            getattr(response, descriptor.name).CopyFrom(value)
        else:
            setattr(response, descriptor.name, value)
    return packer.pack(response).SerializeToString()


class Liar:
    """The proxy's handlers: pass each call to the peer at `upstream`, then lie as MODE_FILE says."""

    def __init__(self, mode_file: Path, upstream: str):
        self.mode_file = mode_file
        options = [("grpc.max_receive_message_length", _MAX_BYTES), ("grpc.max_send_message_length", _MAX_BYTES)]
        self.channel = grpc.insecure_channel(upstream, options=options)
        self.lost = 0  # answers dropped so far

    def mode(self, method: str) -> dict:
        """The lie to tell on `method` now ({"lie": "honest"} when the file says nothing of it)."""
        try:
            mode = json.loads(self.mode_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"lie": "honest"}
        on = mode.get("on")
        if method.lower() not in (on if isinstance(on, list) else [on]) or mode.get("lie", "honest") not in LIES:
            return {"lie": "honest"}
        return mode

    def handler(self) -> grpc.GenericRpcHandler:
        # no (de)serializers: requests and answers pass as bytes
        handlers = {
            "Forward": grpc.unary_unary_rpc_method_handler(self._unary("Forward")),
            "Backward": grpc.unary_unary_rpc_method_handler(self._unary("Backward")),
            "Info": grpc.unary_unary_rpc_method_handler(self._unary("Info")),
            "State": grpc.unary_stream_rpc_method_handler(self._state),
            "Inference": grpc.stream_stream_rpc_method_handler(self._inference),
            "Push": grpc.unary_unary_rpc_method_handler(self._unary("Push")),
            "Commit": grpc.unary_unary_rpc_method_handler(self._unary("Commit")),
            "Apply": grpc.unary_unary_rpc_method_handler(self._unary("Apply")),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def _unary(self, name: str):
        call = self.channel.unary_unary(METHODS[name].path)

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            mode = self.mode(name)
            lie = mode["lie"]
            if lie == "bad_request":
                told(lie, name)
                context.set_trailing_metadata(((ERROR_CODE_KEY, "bad_request"),))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _REFUSAL)
            if lie == "withhold":
                told(lie, name)
                until = time.monotonic() + mode.get("for_s", float("inf"))
                while self.mode(name)["lie"] == "withhold" and (context.time_remaining() or 0) > 0.2:
                    if time.monotonic() > until:
                        break
                    time.sleep(0.1)
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost (a test's proxy withheld the call)")
            try:
                answer = call(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:  # the peer's own refusal, passed on as it is
                context.set_trailing_metadata(tuple(exc.trailing_metadata() or ()))
                context.abort(exc.code(), exc.details())
            if lie == "lose" and self.lost < mode.get("times", 1 << 30):
                self.lost += 1
                told(lie, name)
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost (a test's proxy dropped the answer)")
            if lie in ("honest", "lose") or name not in TENSOR_FIELD:
                return answer
            told(lie, name)
            return self._corrupt_unary(name, answer, lie, mode.get("scale", 1e-2))

        return handle

    def _corrupt_unary(self, name: str, answer: bytes, lie: str, scale: float) -> bytes:
        response_type, field = METHODS[name].response, TENSOR_FIELD[name]
        if lie == "empty":
            return response_type().SerializeToString()
        received = unpack(response_type, answer)
        tensor = decode_tensor(getattr(received.message, field), field, received.payload)
        return replace_tensor(received, field, corrupt(tensor, lie, scale))

    def _state(self, request: bytes, context):
        yield from self.channel.unary_stream(METHODS["State"].path)(request, timeout=context.time_remaining())

    def _inference(self, requests, context):
        outbox: queue.Queue = queue.Queue()

        def sent():
            while (item := outbox.get()) is not None:
                yield item

        answers = self.channel.stream_stream(METHODS["Inference"].path)(sent())
        try:
            for request in requests:
                outbox.put(request)
                try:
                    answer = next(answers)
                except StopIteration:
                    return
                yield self._corrupt_step(request, answer)
        finally:
            outbox.put(None)
            answers.cancel()

    def _corrupt_step(self, request: bytes, answer: bytes) -> bytes:
        mode = self.mode("inference")
        lie = mode["lie"]
        asked = unpack(pb.InferenceRequest, request).message
        if (
            lie == "honest"
            or asked.WhichOneof("kind") != "step"
            or asked.step.prefix_length < mode.get("from_position", 0)
        ):
            return answer
        received = unpack(pb.InferenceResponse, answer)
        if received.message.WhichOneof("kind") != "step":
            return answer
        told(lie, "Inference")
        if lie == "bad_request":
            return pb.InferenceResponse(error=pb.Error(code="bad_request", message=_REFUSAL)).SerializeToString()
        if lie == "kind":
            opened = pb.SessionOpened(session_id=asked.step.session_id, max_length=received.message.step.position)
            return pb.InferenceResponse(opened=opened).SerializeToString()
        if lie == "empty":
            return pb.InferenceResponse().SerializeToString()
        step = received.message.step
        hidden = decode_tensor(step.hidden_states, "hidden_states", received.payload)
        packer = Packer()
        result = pb.StepResult(
            hidden_states=packer.tensor(corrupt(hidden, lie)),
            step_id=step.step_id + (lie == "step_id"),
            position=step.position + (lie == "position"),
        )
        return packer.pack(pb.InferenceResponse(step=result)).SerializeToString()


def told(lie: str, method: str) -> None:
    print(f"lied: {lie} on {method}", flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str]) -> int:
    from swarm.cli import main as swarmlm

    mode_file, args = Path(argv[0]), argv[1:]
    assert args[:1] == ["peer"], "usage: liar.py MODE_FILE peer MODEL [flags]"
    private = _free_port()
    proxy = grpc.server(
        ThreadPoolExecutor(max_workers=32, thread_name_prefix="liar"),
        options=[
            ("grpc.max_receive_message_length", _MAX_BYTES),
            ("grpc.max_send_message_length", _MAX_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    liar = Liar(mode_file, f"127.0.0.1:{private}")
    proxy.add_generic_rpc_handlers((liar.handler(),))
    public = proxy.add_insecure_port("127.0.0.1:0")
    proxy.start()
    print(f"liar: proxy at 127.0.0.1:{public} for the peer at 127.0.0.1:{private}", flush=True)
    try:  # the last of repeated flags wins: these override any the caller gave
        return swarmlm(
            [*args, "--port", str(private), "--announce-host", f"127.0.0.1:{public}", "--transport", "direct"]
        )
    finally:
        proxy.stop(None)
        liar.channel.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
