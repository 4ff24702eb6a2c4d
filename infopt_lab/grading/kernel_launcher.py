"""Start an IPython kernel under resource limits; the grader runs this source with `python -I -c`.

usage: python -I -c SOURCE FILE_BYTES OUTPUT_BYTES [ipykernel arguments...]
Kept free of `infopt_lab` imports so a submission's kernel starts without the package. Memory is
not capped here: an address-space cap breaks the CUDA build of torch, so the grader watches the
kernel's resident memory from outside (`watchdog.py`).
"""
import signal
import sys


def apply_limits(file_bytes: int) -> None:
    """Cap the size of any file written, and core dumps, for this process and its children."""
    import resource
    for limit, value in ((resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)  # never above the admin's cap
        resource.setrlimit(limit, (value, value))
    # Writing past RLIMIT_FSIZE raises SIGXFSZ, which kills by default; ignored, write() fails with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def cap_output(output_bytes: int) -> None:
    """Drop printed text beyond `output_bytes`, so an honest runaway print stays cheap.

    A submission can undo this; the grader's own cap on what it receives still holds.
    """
    from ipykernel import iostream
    write = iostream.OutStream.write
    left = [output_bytes]

    def capped_write(self, string):
        if left[0] > 0:
            write(self, string[: left[0]])
            if len(string) >= left[0]:
                write(self, "\n[grader: further output dropped]\n")
            left[0] -= len(string)
        return len(string)

    iostream.OutStream.write = capped_write


def main() -> None:
    """Apply the limits given on the command line, then hand over to ipykernel."""
    file_bytes, output_bytes = (int(a) for a in sys.argv[1:3])
    if sys.platform != "win32":
        apply_limits(file_bytes)
    cap_output(output_bytes)
    sys.argv = [sys.argv[0]] + sys.argv[3:]
    from ipykernel.kernelapp import launch_new_instance
    launch_new_instance()


if __name__ == "__main__":
    main()
