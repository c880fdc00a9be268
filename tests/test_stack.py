"""The rest of the stack on this machine: Ray starts and runs tasks; the package layers hold."""


def test_ray_starts_without_dashboard_and_runs_a_task(ray_address):
    import ray

    @ray.remote
    def square(x):
        return x * x

    assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]


def test_lower_packages_do_not_import_torch_at_import_time():
    import subprocess
    import sys

    code = "import sys, molt_env; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
