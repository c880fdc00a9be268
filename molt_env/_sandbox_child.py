"""The sandboxed process (see `molt_env.sandbox`): confine this process, then run ./main.py.

Run as `python -I -S _sandbox_child.py CONFIG_JSON` in the sandbox directory.
Order matters: the network namespace needs root, so it comes before the drop
to `nobody`; the audit hook comes last, once everything this file needs is
loaded.
"""

import json
import os
import resource
import sys
import traceback

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000

REFUSED = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
           "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect",
           "socket.bind", "socket.getaddrinfo", "socket.sendto", "resource.setrlimit", "resource.prlimit",
           "os.setuid", "os.setgid", "os.chroot", "ctypes.")
PATH_EVENTS = {"os.listdir", "os.scandir", "os.chdir", "os.chmod", "os.chown", "os.mkdir", "os.remove", "os.rename",
               "os.rmdir", "os.link", "os.symlink", "os.truncate", "os.utime", "os.chflags", "os.setxattr",
               "os.removexattr", "shutil.rmtree", "shutil.copyfile", "shutil.move", "glob.glob", "os.walk"}


# Imported before the drop to `nobody`: where the interpreter lives in a directory only its owner can read
# (a pyenv under /root), these are all the code can import; elsewhere the whole standard library is there.
PRELOAD = ("array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "encodings.idna", "enum", "fractions",
           "functools", "hashlib", "heapq", "itertools", "math", "operator", "pprint", "random", "re", "signal",
           "socket", "statistics", "string", "subprocess", "textwrap", "time", "typing", "unicodedata")


def isolate_network() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if os.geteuid() == 0 and libc.unshare(CLONE_NEWNET) == 0:
            return
        if os.geteuid() != 0:
            libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # where unprivileged user namespaces are allowed
    except OSError:
        pass  # no namespace: socket creation is refused by the hook all the same


def limit(config: dict) -> None:
    # CPU: SIGXCPU at the limit (reported as such), SIGKILL a second later if that is caught.
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu"], config["cpu"] + 1))
    for name, value in (("RLIMIT_AS", config["memory"]), ("RLIMIT_FSIZE", config["fsize"]),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    if config["uid"] is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (config["nproc"], config["nproc"]))
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])


def install_guard(workdir: str) -> None:
    readable = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))

    def within(path, roots) -> bool:
        real = os.path.realpath(os.path.join(workdir, os.fsdecode(path)))
        return any(real == root or real.startswith(root + os.sep) for root in roots)

    def guard(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or within(path, (workdir,)):
                return
            writing = (mode and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if not writing and within(path, readable):
                return
            raise PermissionError(f"sandbox: {path!r} is outside the working directory")
        if event in PATH_EVENTS:
            path = args[0] if args else "."
            if path is None or isinstance(path, int) or within(path, (workdir,)):
                return
            if event in ("os.listdir", "os.scandir") and within(path, readable):
                return
            raise PermissionError(f"sandbox: {path!r} is outside the working directory")
        if event.startswith(REFUSED):
            raise PermissionError(f"sandbox: {event} is not allowed")

    sys.addaudithook(guard)


def main() -> None:
    config = json.loads(sys.argv[1])
    workdir = os.path.realpath(os.getcwd())
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    isolate_network()
    for name in PRELOAD:
        __import__(name)
    limit(config)
    sys.argv = ["main.py"]
    install_guard(workdir)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as error:  # the user's traceback, without this file's frame, after what it printed
        sys.stdout.flush()
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.exit(1)


main()
