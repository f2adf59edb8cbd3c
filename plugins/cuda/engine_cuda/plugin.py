"""Hook implementations of engine-cuda. Imports nothing heavy."""

import engine


@engine.hookimpl
def register_platforms(register):
    register("cuda", "engine_cuda.platform:CudaPlatform")
