"""The sandbox's confinement steps, kept as source text (rljax/rewards/sandbox.py runs it).

It runs between fork and exec, either in-process (preexec_fn, for single-threaded callers) or in
a launcher interpreter (for callers with threads), so it is self-contained source rather than
functions of this package: it must not import rljax.
"""
# The confinement steps, as source: run in-process between fork and exec (preexec_fn) when
# the caller is single-threaded (pool workers), or by a launcher interpreter that then execs
# the sandboxed one when the caller has threads (e.g. a JAX process), where running Python
# between fork and exec is unsafe.
#
# With namespaces the process that called confine() (C, the Popen child) unshares them and
# forks twice: C -> init (PID 1 of the new PID namespace: builds the private root, then only
# reaps) -> the program (PID 2, returns from confine() and execs). C waits for init and
# exits the way the program did (init passes the program's wait status through a pipe:
# PID 1 cannot kill itself with a signal), so Popen sees the program's return code. Killing
# C's process group kills all three; when init dies the kernel kills the rest of the
# namespace, however the program detached its children.
CONFINE_SRC = r"""
import ctypes, os, platform, resource, signal, struct

_NEWNS, _NEWUTS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = (0x00020000, 0x04000000, 0x08000000, 0x10000000,
                                                        0x20000000, 0x40000000)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}.get(platform.machine())
_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE = 442, -100, 0x8000
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _ok(ret, what):
  if ret != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, dst, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  _ok(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


def _readonly(libc, path):
  # The whole bound tree read-only (mount_setattr, Linux 5.12+); else just its top mount,
  # keeping the flags that a user namespace may not clear.
  attr = ctypes.create_string_buffer(struct.pack("QQQQ", 0x1 | 0x2, 0, 0, 0))  # RDONLY | NOSUID
  if libc.syscall(_MOUNT_SETATTR, _AT_FDCWD, path.encode(), _AT_RECURSIVE, attr, 32) == 0:
    return
  locked = 0
  st = os.statvfs(path).f_flag
  for st_bit, ms_bit in ((2, _MS_NOSUID), (4, _MS_NODEV), (8, _MS_NOEXEC), (1024, 1024), (2048, 2048),
                         (4096, 1 << 21)):
    if st & st_bit:
      locked |= ms_bit
  _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | locked)


def _build_root(libc, plan):
  new = plan["root"]
  _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
  _mount(libc, "tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
  for src in plan["binds"]:
    dst = new + src
    if os.path.islink(src):
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
      os.makedirs(dst, exist_ok=True)
      _mount(libc, src, dst, None, _MS_BIND | _MS_REC)
      _readonly(libc, dst)
  # Everything the program can write (/sandbox, /tmp, /dev/shm) is one tmpfs of disk_mb: bound
  # into place, then its own mount point is dropped. It lives in this mount namespace only and
  # is gone with it, whatever the program did to the modes of what it wrote.
  rw = new + "/.rw"
  os.mkdir(rw)
  _mount(libc, "tmpfs", rw, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={plan['disk_mb']}m,mode=755")
  for name, mode in (("sandbox", 0o700), ("tmp", 0o1777), ("shm", 0o1777)):
    os.mkdir(f"{rw}/{name}")
    os.chmod(f"{rw}/{name}", mode)
  for name in os.listdir(plan["work"]):  # the program and its files, staged by the caller
    src = os.path.join(plan["work"], name)
    if os.path.isfile(src) and not os.path.islink(src):
      with open(src, "rb") as f, open(f"{rw}/sandbox/{name}", "wb") as g:
        g.write(f.read())
      if plan["uid"] is not None:
        os.chown(f"{rw}/sandbox/{name}", plan["uid"], plan["uid"])
  if plan["uid"] is not None:
    os.chown(f"{rw}/sandbox", plan["uid"], plan["uid"])
  dev = new + "/dev"
  os.mkdir(dev)
  _mount(libc, "tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=755")
  os.mkdir(dev + "/shm")
  for name, dst in (("sandbox", new + "/sandbox"), ("tmp", new + "/tmp"), ("shm", dev + "/shm")):
    if name != "shm":
      os.mkdir(dst)
    _mount(libc, f"{rw}/{name}", dst, None, _MS_BIND)
    _mount(libc, None, dst, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV)
  _ok(libc.umount2(rw.encode(), 2), "umount the writable tmpfs's mount point")  # MNT_DETACH
  os.rmdir(rw)
  for name in _DEVICES:
    if os.path.exists("/dev/" + name):
      open(f"{dev}/{name}", "w").close()
      _mount(libc, "/dev/" + name, f"{dev}/{name}", None, _MS_BIND)
  for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2")):
    os.symlink(target, f"{dev}/{name}")
  os.mkdir(new + "/proc")
  try:
    _mount(libc, "proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
  except OSError:
    pass  # e.g. inside a container with masked /proc paths: the program runs without /proc
  _mount(libc, None, new, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
  os.chdir(new)
  if _PIVOT_ROOT is not None:
    _ok(libc.syscall(_PIVOT_ROOT, b".", b"."), "pivot_root")
    _ok(libc.umount2(b".", 2), "umount the old root")  # MNT_DETACH
  else:
    _ok(libc.chroot(b"."), "chroot")
  os.chdir("/sandbox")


def _close_fds_but(keep):
  top = os.sysconf("SC_OPEN_MAX")
  os.closerange(3, keep)
  os.closerange(keep + 1, top)


def _exit_like(status):
  if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    try:
      resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
      signal.signal(sig, signal.SIG_DFL)
      signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    except (OSError, ValueError):
      pass
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)
  os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _wait_for(pid):
  while True:
    try:
      return os.waitpid(pid, 0)[1]
    except InterruptedError:
      continue
    except ChildProcessError:
      return 1 << 8


def _relay(libc, init, r, w):
  # C: wait for init, then exit the way the program did.
  os.close(w)
  _close_fds_but(r)  # Popen's error pipe among them: Popen returns once the program execs
  status = _wait_for(init)
  data = os.read(r, 4)
  _exit_like(struct.unpack("i", data)[0] if len(data) == 4 else status)


def _init(program, w):
  # PID 1: reap everything; when the program exits, report its status and end the namespace.
  _close_fds_but(w)
  while True:
    try:
      pid, status = os.waitpid(-1, 0)
    except InterruptedError:
      continue
    except ChildProcessError:
      os._exit(1)
    if pid == program:
      os.write(w, struct.pack("i", status))
      os._exit(0)


def _enter_namespaces(libc, plan):
  uid, gid = os.getuid(), os.getgid()
  flags = _NEWNS | _NEWPID | _NEWIPC | _NEWUTS | (_NEWNET if plan["netns"] else 0)
  if plan["userns"]:
    flags |= _NEWUSER
  _ok(libc.unshare(flags), "unshare")
  if plan["userns"]:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  r, w = os.pipe()
  init = os.fork()
  if init:
    _relay(libc, init, r, w)
  os.close(r)
  libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL: init dies with C
  _build_root(libc, plan)
  program = os.fork()
  if program:
    _init(program, w)
  os.close(w)


def confine(plan):
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL
  if plan["namespaces"]:
    _enter_namespaces(libc, plan)
  elif plan["netns"]:
    _ok(libc.unshare(_NEWNET), "unshare(CLONE_NEWNET)")
  for name, soft, hard in plan["rlimits"]:
    which = getattr(resource, name)
    try:
      resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
      cap = resource.getrlimit(which)[1]
      if cap != resource.RLIM_INFINITY:
        resource.setrlimit(which, (min(soft, cap), min(hard, cap)))
  uid = plan["uid"]
  if uid is not None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
  libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
  libc.prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG again: fork and the uid change clear it
"""
