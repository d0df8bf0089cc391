"""The module-level ``__getattr__`` of the stand-in's modules: any name is a
function that raises."""


def unavailable(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            raise RuntimeError(f"torchvision stand-in: {module}.{name} is not available")

        return call

    return __getattr__
