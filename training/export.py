"""Export the deterministic PPO actor to ONNX with VecNormalize's observation normalisation folded in.

    tidegate export runs/ppo/model.zip [runs/ppo/policy.onnx] [--vecnormalize runs/ppo/vecnormalize.pkl]

The graph computes ``clip(action_net(tanh MLP(clip((obs - mean) / std, -c, c))), -1, 1)``, which is
what ``model.predict(obs, deterministic=True)`` returns for VecNormalize-d observations. The
initializers are named ``obs_mean``, ``obs_std``, ``layer{i}.weight``/``.bias`` and
``action.weight``/``.bias`` so ``ctrl.learned.NumpyPolicy`` can run it without a runtime.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tidegate.training.errors import ExportError
from tidegate.training.train import vecnormalize_path


class _Actor(nn.Module):
    def __init__(self, mean: np.ndarray, std: np.ndarray, clip_obs: float, hidden: list[nn.Linear],
                 action: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("obs_mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("obs_std", torch.as_tensor(std, dtype=torch.float32))
        self.clip_obs = float(clip_obs)
        for i, layer in enumerate(hidden):
            setattr(self, f"layer{i}", layer)
        self.n_hidden = len(hidden)
        self.action = action

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = torch.clamp((obs - self.obs_mean) / self.obs_std, -self.clip_obs, self.clip_obs)
        for i in range(self.n_hidden):
            x = torch.tanh(getattr(self, f"layer{i}")(x))
        return torch.clamp(self.action(x), -1.0, 1.0)


def build_actor(model, vecnormalize=None) -> _Actor:
    """The deterministic actor of an SB3 PPO ``model`` as a torch module with normalisation folded in."""
    policy = model.policy
    net = policy.mlp_extractor.policy_net
    hidden = [m for m in net if isinstance(m, nn.Linear)]
    acts = [m for m in net if not isinstance(m, nn.Linear)]
    if not all(isinstance(a, nn.Tanh) for a in acts):
        raise ExportError("only tanh MLP actors (SB3's default) can be exported")
    dim = policy.observation_space.shape[0]
    if vecnormalize is not None and vecnormalize.norm_obs:
        mean = vecnormalize.obs_rms.mean
        std = np.sqrt(vecnormalize.obs_rms.var + vecnormalize.epsilon)
        clip_obs = vecnormalize.clip_obs
    else:
        mean, std, clip_obs = np.zeros(dim), np.ones(dim), np.inf
    return _Actor(mean, std, min(clip_obs, 1e30), [_clone(m) for m in hidden], _clone(policy.action_net)).eval()


def _clone(m: nn.Linear) -> nn.Linear:
    c = nn.Linear(m.in_features, m.out_features)
    with torch.no_grad():
        c.weight.copy_(m.weight.detach().cpu())
        c.bias.copy_(m.bias.detach().cpu())
    return c.eval()


def default_export_path(checkpoint: str | Path) -> Path:
    """Where :func:`export` writes unless told: ``policy.onnx`` in the checkpoint's folder (so
    ``checkpoints/model.zip`` reproduces the shipped ``checkpoints/policy.onnx``)."""
    return Path(checkpoint).with_name("policy.onnx")


def export(checkpoint: str | Path, out: str | Path | None = None, vecnormalize: str | Path | None = None,
           residual_scale: float | None = None) -> Path:
    """Write the deterministic actor of ``checkpoint`` to ONNX.

    :param checkpoint: an SB3 PPO ``.zip`` (``model.zip`` or a CheckpointCallback file).
    :param out: the ``.onnx`` file to write (default: :func:`default_export_path`).
    :param vecnormalize: the VecNormalize statistics (default: the file saved beside the model,
        :func:`training.train.vecnormalize_path`; none found there means no normalisation).
    :param residual_scale: the share of the action the learned controller applies, in [0, 1],
        recorded in the file (None: none recorded, which reads as 1).
    :return: the path written.
    :raises ExportError: the checkpoint or the statistics are missing or unreadable, ``out`` cannot
        be written, or the residual scale is not in [0, 1].
    """
    from stable_baselines3 import PPO

    scale = _checked_scale(residual_scale)

    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise ExportError(f"{checkpoint}: no such checkpoint")
    try:
        model = PPO.load(str(checkpoint), device="cpu")
    except Exception as exc:  # SB3 raises whatever unzipping or unpickling a foreign file does
        raise ExportError(f"{checkpoint}: not a stable-baselines3 PPO checkpoint ({type(exc).__name__})") from None
    actor = build_actor(model, _load_vecnormalize(checkpoint, vecnormalize))
    out = default_export_path(checkpoint) if out is None else Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_onnx(actor, model.policy.observation_space.shape[0], out, source=checkpoint, residual_scale=scale)
    except OSError as exc:
        raise ExportError(f"{out}: cannot write the policy ({exc.strerror or type(exc).__name__})") from None
    return out


def _checked_scale(value) -> float | None:
    if value is None:
        return None
    from tidegate.ctrl.learned import residual_scale_of

    try:
        return residual_scale_of(value)
    except ValueError as exc:
        raise ExportError(str(exc)) from None


def set_residual_scale(policy: str | Path, scale: float, out: str | Path | None = None) -> Path:
    """Record ``scale`` as the residual scale of the ONNX policy at ``policy`` (in place, or into
    ``out``); the learned controller applies ``RESIDUAL_RANGE ** (scale * action)``.

    :raises ExportError: the file is not an ONNX model, cannot be written, or the scale is not in [0, 1].
    """
    import onnx

    from tidegate.ctrl.policy import RESIDUAL_SCALE_KEY

    checked = _checked_scale(scale)
    assert checked is not None
    src = Path(policy)
    dst = src if out is None else Path(out)
    try:
        proto = onnx.load(str(src))
    except Exception as exc:  # onnx raises DecodeError, OSError or others for a foreign file
        raise ExportError(f"{src}: not an ONNX policy ({type(exc).__name__})") from None
    for i in reversed(range(len(proto.metadata_props))):
        if proto.metadata_props[i].key == RESIDUAL_SCALE_KEY:
            del proto.metadata_props[i]
    entry = proto.metadata_props.add()
    entry.key, entry.value = RESIDUAL_SCALE_KEY, repr(checked)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(proto, str(dst))
    except OSError as exc:
        raise ExportError(f"{dst}: cannot write the policy ({exc.strerror or type(exc).__name__})") from None
    return dst


def _load_vecnormalize(checkpoint: Path, vecnormalize: str | Path | None):
    """The VecNormalize object given, or the one saved beside ``checkpoint``, or None."""
    path = Path(vecnormalize) if vecnormalize else vecnormalize_path(checkpoint)
    if not path.is_file():
        if vecnormalize:
            raise ExportError(f"{path}: no such VecNormalize file")
        return None
    try:
        with open(path, "rb") as f:
            vn = pickle.load(f)
    except Exception as exc:  # unpickling a foreign file can raise almost anything
        raise ExportError(f"{path}: not a VecNormalize file ({type(exc).__name__})") from None
    if not hasattr(vn, "obs_rms"):
        raise ExportError(f"{path}: not a VecNormalize file (a pickled {type(vn).__name__})")
    return vn


def _write_onnx(actor: _Actor, obs_dim: int, out: Path, source: Path, residual_scale: float | None = None) -> None:
    with warnings.catch_warnings():
        # the torch.export-based exporter needs onnxscript; the TorchScript one is exact for an MLP
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(actor, torch.zeros(1, obs_dim), str(out), input_names=["obs"], output_names=["action"],
                          dynamic_axes={"obs": {0: "batch"}, "action": {0: "batch"}}, opset_version=17,
                          dynamo=False, do_constant_folding=False)
    import onnx

    proto = onnx.load(str(out))
    entry = proto.metadata_props.add()
    entry.key, entry.value = "clip_obs", repr(actor.clip_obs)
    entry = proto.metadata_props.add()
    entry.key, entry.value = "source", str(source)
    if residual_scale is not None:
        from tidegate.ctrl.policy import RESIDUAL_SCALE_KEY

        entry = proto.metadata_props.add()
        entry.key, entry.value = RESIDUAL_SCALE_KEY, repr(residual_scale)
    onnx.save(proto, str(out))
