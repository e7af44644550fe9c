"""Loading and running an exported policy: the PPO actor that ``training/export.py`` writes to ONNX
(VecNormalize folded in), as a callable ``obs -> action in [-1, 1]^3``.

Two runtimes read the same file: ``NumpyPolicy`` (a numpy forward pass over the file's weights,
the default: faster than a runtime for this small MLP) and ``OnnxPolicy`` (onnxruntime).
``ctrl.learned`` decides when to call one and what to do when it cannot answer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: the bound of every observation entry; also the normalised-observation clip of a policy file that
#: records none
OBS_CLIP = 10.0


class PolicyError(RuntimeError):
    """The policy could not answer this step."""


#: the metadata key of a policy file's residual scale (``ctrl.learned.LearnedController``)
RESIDUAL_SCALE_KEY = "residual_scale"


def _residual_scale(meta: dict[str, str]) -> float | str:
    """The file's residual scale (1 when it records none); the raw text if it is not a number,
    for the controller to refuse with its own message."""
    text = meta.get(RESIDUAL_SCALE_KEY)
    if text is None:
        return 1.0
    try:
        return float(text)
    except ValueError:
        return text


class OnnxPolicy:
    """The exported actor (VecNormalize folded in) run with onnxruntime: obs -> action in [-1, 1]."""

    def __init__(self, path: str | Path) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.residual_scale = _residual_scale(dict(self.session.get_modelmeta().custom_metadata_map))

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: obs.reshape(1, -1)})[0][0]


class NumpyPolicy:
    """The same actor as a numpy forward pass over the ONNX file's weights (no runtime needed).

    The export names its initializers ``obs_mean``, ``obs_std``, ``layer{i}.weight``/``.bias``
    (hidden, tanh) and ``action.weight``/``.bias``; see ``training/export.py``.
    """

    def __init__(self, path: str | Path) -> None:
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        w = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
        meta = {p.key: p.value for p in model.metadata_props}
        self.clip = float(meta.get("clip_obs", OBS_CLIP))
        self.residual_scale = _residual_scale(meta)
        self.mean = w["obs_mean"]
        self.inv_std = (1.0 / w["obs_std"]).astype(np.float32)
        self.layers = []
        i = 0
        while f"layer{i}.weight" in w:
            self.layers.append((w[f"layer{i}.weight"].T.copy(), w[f"layer{i}.bias"]))
            i += 1
        self.action = (w["action.weight"].T.copy(), w["action.bias"])
        if not self.layers:
            raise PolicyError(f"{path}: no layer0.weight in the ONNX file, expected an export of training/export.py")

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        # np.minimum/np.maximum: np.clip costs more than the matmuls at this size
        c = self.clip
        x = np.maximum(np.minimum((obs - self.mean) * self.inv_std, c), -c)
        for weight, bias in self.layers:
            x = np.tanh(x @ weight + bias)
        a = x @ self.action[0] + self.action[1]
        return np.maximum(np.minimum(a, 1.0), -1.0)


def load_policy(path: str | Path, runtime: str = "numpy"):
    """The policy at ``path`` run by ``numpy`` or ``onnxruntime``."""
    if runtime == "numpy":
        return NumpyPolicy(path)
    if runtime == "onnxruntime":
        return OnnxPolicy(path)
    raise ValueError(f"runtime must be numpy or onnxruntime, got {runtime!r}")


def as_action(action) -> tuple[float, float, float]:
    """A policy's answer as three floats (not checked for range or NaN)."""
    return float(action[0]), float(action[1]), float(action[2])
