"""Copies one batch ahead on a side stream: the order of CUDA calls, with a recording stand-in
for the stream API (the only thing mocked: this host has no GPU; tests/engine/test_gpu.py runs
the real streams)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fdl.engine.h2d import DeviceCopies


class Recorder:
    """The stream API, writing down each call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.on_side = False

    def new_stream(self):
        return "side"

    def current(self):
        return "compute"

    @contextlib.contextmanager
    def on(self, stream):
        self.calls.append(("enter", stream))
        self.on_side = True
        try:
            yield
        finally:
            self.on_side = False
            self.calls.append(("exit", stream))

    def record_event(self, stream):
        event = f"event{sum(1 for c in self.calls if c[0] == 'record')}"
        self.calls.append(("record", stream, event))
        return event

    def wait(self, stream, event):
        self.calls.append(("wait", stream, event))

    def used_by(self, tensor, stream):
        self.calls.append(("used_by", int(tensor.reshape(-1)[0]), stream))


def host_batches(count: int, fetched: list[int], recorder: Recorder):
    """fetch() of ``count`` host batches (x, y), each noting when it was fetched."""
    source = iter(range(count))

    def fetch():
        index = next(source)
        assert not recorder.on_side  # the host work happens off the side stream's context
        fetched.append(index)
        recorder.calls.append(("fetch", index))
        return (torch.full((2,), index), torch.full((1,), 10 + index))

    return fetch


def test_each_batch_is_copied_a_call_ahead_and_waited_for_on_the_gpu():
    recorder, fetched = Recorder(), []
    copies = DeviceCopies(torch.device("cpu"), streams=recorder)
    fetch = copies.ahead(host_batches(3, fetched, recorder), 3)
    first = fetch()
    assert torch.equal(first[0], torch.full((2,), 0)) and fetched == [0, 1]
    assert recorder.calls == [
        ("fetch", 0), ("enter", "side"), ("record", "side", "event0"), ("exit", "side"),
        ("wait", "compute", "event0"), ("used_by", 0, "compute"), ("used_by", 10, "compute"),
        ("fetch", 1), ("enter", "side"), ("record", "side", "event1"), ("exit", "side")]
    assert [int(fetch()[1][0]) for _ in range(2)] == [11, 12]
    assert fetched == [0, 1, 2]  # never past the slice's count
    waits = [c[2] for c in recorder.calls if c[0] == "wait"]
    assert waits == ["event0", "event1", "event2"]  # each batch's own event, in order
    with pytest.raises(StopIteration):
        fetch()


def test_a_slice_stopped_early_fetches_one_batch_more_at_most():
    recorder, fetched = Recorder(), []
    fetch = DeviceCopies(torch.device("cpu"), streams=recorder).ahead(
        host_batches(10, fetched, recorder), 10)
    fetch(), fetch()
    assert fetched == [0, 1, 2]  # the elastic rank stopped after 2: one batch in flight


def test_no_copies_off_cuda():
    assert DeviceCopies.for_device(torch.device("cpu")) is None


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_steps_every_batch_through_the_copies_and_trains_the_same(monkeypatch, workers):
    """fdl.Trainer alone, in this process, with the engine's copies given the recording stream
    API as if the device were CUDA: every batch the run trains on went through them (one wait
    per batch), and the model is what a run without them trains, bit for bit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from common import build_model, build_optimizer, make_data, train_step

    import fdl
    import fdl.engine.feed as feed

    def trained():
        return fdl.Trainer(model=build_model, optimizer=build_optimizer, train_step=train_step,
                           train_data=make_data(512, seed=1), batch_size=32, epochs=2, seed=3,
                           num_workers=workers).fit()

    plain = trained()
    recorder = Recorder()
    monkeypatch.setattr(feed.DeviceCopies, "for_device",
                        classmethod(lambda cls, device: cls(device, streams=recorder)))
    through = trained()
    waits = [c for c in recorder.calls if c[0] == "wait"]
    assert len(waits) == 2 * 512 // 32
    assert len({c[2] for c in waits}) == len(waits)  # each batch its own event
    for (name, x), (_, y) in zip(plain.model.state_dict().items(),
                                 through.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
