"""The engine keeps working in a process forked after it was used (DataLoader workers, launchers)."""
import os
import signal

import torch

from recsave.format import write_shards


def test_engine_works_in_a_forked_child(tmp_path):
    tensors = {"a": torch.arange(1 << 18, dtype=torch.float32)}
    write_shards(str(tmp_path), tensors, concurrency=4, segment_bytes=4096)  # starts the thread pool
    child_dir = tmp_path / "child"
    child_dir.mkdir()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        signal.alarm(20)
        try:
            write_shards(str(child_dir), tensors, concurrency=4, segment_bytes=4096)
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    assert (child_dir / "sparse-0-0.safetensors").exists()
