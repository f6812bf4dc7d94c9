"""The sandbox's files on the host (rljax/rewards/sandbox.py): the staged program, its memory-backed
stdin/stdout/stderr, and a cleanup that modes set inside cannot defeat."""
from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile

log = logging.getLogger("rljax.rewards")


def memfile(name: str):
  """A read-write binary file in memory (memfd), or an unlinked temp file where memfd is missing."""
  if hasattr(os, "memfd_create"):
    try:
      return os.fdopen(os.memfd_create(f"rljax-sbx-{name}", os.MFD_CLOEXEC), "w+b")
    except OSError:
      pass
  return tempfile.TemporaryFile()


def _unlock(path: str) -> None:
  """Makes `path` and every directory under it accessible to its owner again (chmod 000 inside)."""
  try:
    os.chmod(path, 0o700)
    entries = list(os.scandir(path))
  except OSError:
    return
  for entry in entries:
    try:
      if entry.is_dir(follow_symlinks=False):
        _unlock(entry.path)
    except OSError:
      pass


def remove_tree(path: str) -> None:
  """Removes a directory tree whatever modes were set inside it (a directory made unreadable or
  unwritable by sandboxed code running as this user, without namespaces). Says so when it cannot."""
  if not os.path.lexists(path):
    return
  shutil.rmtree(path, ignore_errors=True)
  if os.path.lexists(path):
    _unlock(path)
    shutil.rmtree(path, ignore_errors=True)
  if os.path.lexists(path):
    log.warning("sandbox: could not remove %s", path)


def read_capped(f, cap: int) -> tuple[str, bool]:
  f.seek(0)
  data = f.read(cap + 1)
  return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def read_tail(f, size: int = 4096) -> str:
  end = f.seek(0, os.SEEK_END)
  f.seek(max(0, end - size))
  return f.read(size).decode("utf-8", errors="replace")


def remove_dirs_of(tag: str) -> None:
  """Removes the sandbox dirs left by the worker tagged `tag` (killed in the middle of a run)."""
  for path in glob.glob(os.path.join(tempfile.gettempdir(), f"rljax-sbx-{tag}-*")):
    if path.endswith(".root"):
      try:
        os.rmdir(path)
      except OSError:
        pass
    else:
      remove_tree(path)
