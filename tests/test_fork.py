"""The engine keeps working in a process forked after it was used (DataLoader workers, launchers)."""
import os
import signal

import torch

from recsave.format import write_shards


def _in_child(body) -> int:
    """Runs `body` in a forked child (20 s at most); its wait status: exit 0 when `body` returned."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        signal.alarm(20)
        try:
            body()
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1]


def test_engine_works_in_a_forked_child(tmp_path):
    tensors = {"a": torch.arange(1 << 18, dtype=torch.float32)}
    write_shards(str(tmp_path), tensors, concurrency=4, segment_bytes=4096)  # starts the thread pool
    child_dir = tmp_path / "child"
    child_dir.mkdir()
    status = _in_child(lambda: write_shards(str(child_dir), tensors, concurrency=4, segment_bytes=4096))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    assert (child_dir / "sparse-0-0.safetensors").exists()


def test_a_saver_busy_on_another_thread_at_the_fork_is_usable_in_the_child(tmp_path):
    """The Saver's call lock (its public calls take turns) was inherited held by a thread the
    child does not have: every Saver call there hung."""
    import threading

    import recsave

    model = torch.nn.Module()
    model.lin = torch.nn.Linear(4, 4)
    saver = recsave.Saver(model, output_dir=str(tmp_path / "run"))
    inside, release = threading.Event(), threading.Event()

    class Slow:  # an extra whose state_dict holds the save on its thread
        def state_dict(self):
            inside.set()
            release.wait(60)
            return {}

        def load_state_dict(self, state):
            pass
    saver.register_for_checkpointing("slow", Slow())
    saving = threading.Thread(target=lambda: saver.save("ckpt_1"))
    saving.start()
    assert inside.wait(60)
    def child() -> None:
        assert saver.wait() is None and saver.checkpoints() == []
    status = _in_child(child)
    release.set()
    saving.join(60)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    assert saver.checkpoints()[-1].endswith("ckpt_1")


def test_an_async_save_in_a_child_forked_while_a_write_ended_does_not_hang(tmp_path):
    """The process-wide lock of the set of running writes (save/background.py) was a plain lock:
    forked while a write's thread held it (its done callback), the child hung in its first
    async_save (and, with several ranks, in every save or load)."""
    import threading

    import recsave
    from recsave.save import background

    model = torch.nn.Module()
    model.lin = torch.nn.Linear(4, 4)
    saver = recsave.Saver(model, output_dir=str(tmp_path / "run"))
    held, release = threading.Event(), threading.Event()

    def ending_write():  # what a write's done callback does, caught at the fork
        with background._running_lock:
            held.set()
            release.wait(60)
    holder = threading.Thread(target=ending_write)
    holder.start()
    assert held.wait(60)
    def child() -> None:
        saver.async_save("ckpt_1")[1].result(20)
        saver.wait()
    status = _in_child(child)
    release.set()
    holder.join(60)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
