"""The worker's process-state check (rljax/rewards/procstate.py) on threads: a thread the item
joined is not a leak even while the kernel still counts it; a thread left running is."""
import threading

from rljax.rewards.procstate import ProcessState


def test_joined_threads_are_not_reported_and_running_ones_are():
  state = ProcessState(rss_growth_mb=1024)
  for _ in range(200):   # join() returns a moment before the kernel drops the thread: many tries
    threads = [threading.Thread(target=lambda: None) for _ in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert state.check() is None
  stop = threading.Event()
  left = threading.Thread(target=stop.wait, daemon=True)
  left.start()
  try:
    assert state.check() == "left 1 thread(s) running"
  finally:
    stop.set()
    left.join()
  assert state.check() is None
