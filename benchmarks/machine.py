"""The machine a benchmark ran on, for its first line: shared by the benchmark scripts
(imported by name: a script's own folder is first on sys.path)."""
import platform


def cpu_name() -> str:
    """the CPU's model name from /proc/cpuinfo, or what platform knows"""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"
