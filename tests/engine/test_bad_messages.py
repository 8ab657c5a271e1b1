"""What is read of an engine message that cannot be encoded or decoded (engine/bad_messages.py), and
the engine process's pipes (engine/core_proc_wire.py) answering one without stopping: the unit half.
Through the real engine process: tests/engine/test_bad_messages_process.py."""

from __future__ import annotations

import multiprocessing

import msgspec
import numpy as np
import pytest

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine import messages as m
from pagedllm.engine.bad_messages import (
    command_request_ids,
    readable_decode_error,
    salvage_reply,
    split_step_outputs,
    unencodable_path,
)
from pagedllm.engine.core_proc_wire import CommandReader, ReplyWriter
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

STATS = SchedulerStats(1, 0, 0.25, 0, 32, 16)


def add(rid: str, **params: object) -> m.AddRequests:
    sp = SamplingParams(max_tokens=4)
    for name, value in params.items():  # set after validation: what slipped through it
        setattr(sp, name, value)
    return m.AddRequests([m.EngineCoreRequest.from_request(Request(rid, [5, 6], sp, arrival_time=1.0))])


@pytest.mark.parametrize(("value", "shown"), [
    (np.float64(0.5), "numpy.float64 0.5"),
    (2**70, "int 1180591620717411303424"),
    ("\ud800", "str '\\ud800'"),
])
def test_the_unencodable_value_is_named_by_its_path(value, shown):
    cmd = add("a-0", seed=value) if not isinstance(value, str) else add("a-0", stop=["ok", value])
    with pytest.raises((msgspec.EncodeError, TypeError, ValueError, OverflowError, NotImplementedError)):
        m.encode(cmd)
    where = unencodable_path(cmd)
    field = "seed" if not isinstance(value, str) else "stop[1]"
    assert where == f"requests[0].sampling_params.{field} ({shown})"
    assert unencodable_path(add("a-0")) is None
    assert unencodable_path({"k": [1, object()]}).startswith("['k'][1] (object <object object")


def test_the_request_ids_of_an_undecodable_command():
    raw = msgspec.msgpack.decode(m.encode(add("a-0")))
    raw[1][0][2]["max_tokens"] = "lots"  # AddRequests -> requests[0] -> sampling_params
    frame = msgspec.msgpack.encode(raw)
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        m.command_decoder.decode(frame)
    assert command_request_ids(frame) == ["a-0"]
    with pytest.raises(msgspec.ValidationError) as e:
        m.command_decoder.decode(frame)
    assert readable_decode_error(frame, e.value) == (
        "Expected `int | null`, got `str` - at requests[0].sampling_params.max_tokens")
    raw[1][0][1] = [5, "six"]
    frame = msgspec.msgpack.encode(raw)
    with pytest.raises(msgspec.ValidationError) as e:
        m.command_decoder.decode(frame)
    assert readable_decode_error(frame, e.value).endswith("at requests[0].prompt_token_ids[1]")
    assert readable_decode_error(b"\xc1", e.value) == str(e.value)  # no command tag: msgspec's words
    assert command_request_ids(b"\xc1 not msgpack") == []
    assert command_request_ids(msgspec.msgpack.encode(["AbortRequests", [1]])) == []


def _out(rid: str, token: object) -> EngineCoreOutput:
    return EngineCoreOutput(rid, [token])  # type: ignore[list-item]


def test_a_step_with_an_unencodable_output_goes_without_it():
    step = m.StepOutputs([_out("a", 3), _out("b", np.int64(4)), _out("c", 5)], STATS, [0.5], 7)
    with pytest.raises(NotImplementedError):
        m.encode(step)
    good, failed = split_step_outputs(step)
    assert [o.request_id for o in good.outputs] == ["a", "c"] and good.num_steps == 7 and good.stats == STATS
    assert [f.request_id for f in failed.failures] == ["b"]
    assert "outputs[1].new_token_ids[0] (numpy.int64 4) cannot be encoded" in failed.failures[0].error.message
    assert m.reply_decoder.decode(m.encode(good)) == good


def test_an_undecodable_reply_keeps_its_readable_outputs():
    step = m.StepOutputs([_out("a", 3), _out("b", 4)], STATS, [], 2)
    raw = msgspec.msgpack.decode(m.encode(step))
    raw[1][1]["new_token_ids"] = ["four"]  # StepOutputs -> outputs[1]
    frame = msgspec.msgpack.encode(raw)
    with pytest.raises(msgspec.ValidationError) as e:
        m.reply_decoder.decode(frame)
    reply, failed = salvage_reply(frame, e.value)
    assert reply == m.StepOutputs([_out("a", 3)], STATS, [], 2)
    assert failed == {"b": "the engine's reply for this request could not be read: Expected `int`, got `str` - at "
                           "new_token_ids[0]"}
    raw[3] = {"not": "stats"}  # the envelope too: no step, its requests still fail
    reply, failed = salvage_reply(msgspec.msgpack.encode(raw), e.value)
    assert reply is None and list(failed) == ["a", "b"]
    assert failed["a"].endswith("- at outputs[1].new_token_ids[0]")  # the error the caller met, in names
    assert salvage_reply(b"\xc1", e.value) == (None, {})


def test_error_messages_always_encode():
    info = m.ErrorInfo.from_exception(ValueError("bad stop '\ud800'"))
    assert m.reply_decoder.decode(m.encode(m.EngineDead(info))).error.message == "bad stop '\\ud800'"


def test_the_engine_process_pipes_answer_a_bad_message_and_go_on():
    """CommandReader / ReplyWriter over a real pipe, in this process."""
    cmd_recv, cmd_send = multiprocessing.Pipe(duplex=False)
    out_recv, out_send = multiprocessing.Pipe(duplex=False)
    emit = ReplyWriter(out_send)
    read = CommandReader(cmd_recv, emit)
    raw = msgspec.msgpack.decode(m.encode(add("bad-0")))
    raw[1][0][2]["n"] = 0  # fails SamplingParams' own check while decoding
    cmd_send.send_bytes(b"\x92\xc1")  # not msgpack
    cmd_send.send_bytes(msgspec.msgpack.encode(raw))
    cmd_send.send_bytes(m.encode(add("good-0")))
    assert read(True) == [add("good-0")]
    failed = m.reply_decoder.decode(out_recv.recv_bytes())
    assert isinstance(failed, m.RequestsFailed) and [f.request_id for f in failed.failures] == ["bad-0"]
    assert "could not read this request" in failed.failures[0].error.message
    assert "n must be" in failed.failures[0].error.message
    assert not out_recv.poll(0)  # the garbage frame had nobody to answer
    cmd_send.send_bytes(b"\xc1")
    assert read(True) == []  # only bad frames: nothing to apply, the loop asks again
    assert read(False) == []

    emit(m.StepOutputs([_out("a", 3), _out("b", np.float32(1.0))], STATS, [], 4))
    step = m.reply_decoder.decode(out_recv.recv_bytes())
    failed = m.reply_decoder.decode(out_recv.recv_bytes())
    assert step == m.StepOutputs([_out("a", 3)], STATS, [], 4)
    assert [f.request_id for f in failed.failures] == ["b"]
    with pytest.raises(OverflowError):  # the engine's own replies are not excused
        emit(m.PrefixCacheReset(2**70, True))
    for conn in (cmd_recv, cmd_send, out_recv, out_send):
        conn.close()


def test_a_request_the_loop_cannot_build_fails_alone():
    """In the engine thread commands are not encoded at all: a request that cannot become a Request
    (here: no prompt) fails alone in EngineCoreLoop.apply, the others of the command are added."""
    from pagedllm.engine.core_loop import EngineCoreLoop

    class Core:
        def __init__(self) -> None:
            self.added: list[str] = []

        def add_request(self, req: Request) -> None:
            self.added.append(req.request_id)

    core, emitted = Core(), []
    loop = EngineCoreLoop(core, lambda reply: emitted.append(reply) or True)  # type: ignore[arg-type]
    bad = m.EngineCoreRequest("bad-0", None, SamplingParams(), 0.0, None, [])  # type: ignore[arg-type]
    assert loop.apply([m.AddRequests([bad, add("good-0").requests[0]])]) is True
    assert core.added == ["good-0"]
    (failed,) = emitted
    assert [(f.request_id, f.error.type_name) for f in failed.failures] == [("bad-0", "TypeError")]
