"""Hostile code against the tool sandbox: each attack is contained, reported as an error, and we go on."""

import os
import socket
import time
import uuid

import pytest

from molt_env.sandbox import NOBODY, Sandbox


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(timeout=3, cpu_seconds=3, memory_mb=256, max_output=2000, max_file_mb=4)


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except FileNotFoundError:
                pass
    return pids


def test_ordinary_code_runs_and_prints(sandbox):
    result = sandbox.run("import math, json\nprint(json.dumps([math.factorial(10), pow(3, 200, 1000)]))")
    assert result.ok and result.output.strip() == "[3628800, 1]"
    assert sandbox.run("open('scratch.txt', 'w').write('kept')\nprint(open('scratch.txt').read())").output == "kept\n"


def test_an_infinite_loop_is_killed_at_the_time_limit(sandbox):
    # Busy: the CPU limit and the wall-clock limit are both 3 s here; whichever fires first names itself.
    result = sandbox.run("while True:\n    pass")
    assert result.error.startswith(("timeout", "terminated: CPU time limit")), result.error
    assert result.seconds < sandbox.timeout + 2
    # Idle: only the wall clock can stop it.
    result = sandbox.run("import time\nwhile True:\n    time.sleep(0.1)")
    assert result.error.startswith("timeout") and result.seconds < sandbox.timeout + 2, result


def test_a_fork_bomb_starts_nothing(sandbox):
    before = set(_processes_of(NOBODY))
    result = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert "os.fork is not allowed" in result.error
    result = sandbox.run("import subprocess\nsubprocess.Popen(['sleep', '100'])")
    assert "subprocess.Popen is not allowed" in result.error
    time.sleep(0.2)
    assert set(_processes_of(NOBODY)) <= before, "a sandboxed process outlived its run"


def test_a_memory_hog_hits_the_memory_limit(sandbox):
    result = sandbox.run("hog = bytearray(2 * 1024 ** 3)\nprint('allocated')")
    assert "MemoryError" in result.error and "allocated" not in result.output
    result = sandbox.run("hog = []\nwhile True:\n    hog.append(' ' * 10 ** 6)")
    assert "MemoryError" in result.error


def test_a_100_mb_print_is_cut_off(sandbox):
    started = time.perf_counter()
    result = sandbox.run("print('x' * (100 * 1024 * 1024))")
    assert result.error.startswith("output limit")
    assert len(result.output) < sandbox.max_output + 100 and "[output truncated" in result.output
    assert time.perf_counter() - started < 10


def test_files_outside_its_directory_are_out_of_reach(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    token = uuid.uuid4().hex
    secret.write_text(token)
    secret.chmod(0o644)  # readable by anyone: only the sandbox itself stands in the way
    for code in (f"print(open({str(secret)!r}).read())", "print(open('/etc/passwd').read())",
                 "print(open('../../../../etc/hostname').read())", "import os\nprint(os.listdir('/'))",
                 f"import os\nos.remove({str(secret)!r})"):
        result = sandbox.run(code)
        assert "outside the working directory" in result.error, (code, result)
        assert token not in result.output
    assert secret.read_text() == token


def test_no_network(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        for code in (f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
                     f"import socket\nsocket.create_connection(('localhost', {port}), timeout=1)\nprint('connected')"):
            result = sandbox.run(code)
            assert "not allowed" in result.error and "connected" not in result.output
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody ever knocked


def test_it_cannot_kill_its_parent(sandbox):
    for code in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                 "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
                 "import ctypes\nctypes.CDLL(None).kill(0, 9)"):
        result = sandbox.run(code)
        assert "not allowed" in result.error, (code, result)
    assert sandbox.run("print('still here')").output == "still here\n"  # and we are still here


def test_errors_name_the_problem_and_the_tool_message_carries_them(sandbox):
    result = sandbox.run("print('partial')\n1 / 0")
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.message().startswith("partial") and result.message().endswith("[error] ZeroDivisionError: division by zero")
    assert "_sandbox_child" not in result.output  # the traceback shows the tool's code only
