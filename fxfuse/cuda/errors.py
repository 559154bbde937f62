"""The one exception of the CUDA path (its own module so that importing fxfuse.cuda stays cheap)."""


class BuildError(RuntimeError):
    """A module could not be generated, compiled or loaded; the message ends with the compiler's
    output. The fused chain should stay unfused (with Inductor)."""
