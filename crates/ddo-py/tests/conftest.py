"""Tiny random models of several Diffusers and transformers architectures."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# The tests keep ddo's cache folder (the machine profile, encoded files) out of the user's.
os.environ["DDO_CACHE_DIR"] = tempfile.mkdtemp(prefix="ddo-test-cache-")


def seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)


@pytest.fixture
def flux():
    return tiny_flux()


def tiny_flux():
    """A two-double, two-single-block Flux transformer (eval mode) and inputs for it."""
    from diffusers import FluxTransformer2DModel

    seeded(1)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
    ).eval()
    seeded(2)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 4),
        encoder_hidden_states=torch.randn(1, 8, 32),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )
    return model, inputs


@pytest.fixture
def sd3():
    from diffusers import SD3Transformer2DModel

    seeded(3)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=4,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
    ).eval()
    seeded(4)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8),
        encoder_hidden_states=torch.randn(1, 6, 16),
        pooled_projections=torch.randn(1, 16),
        timestep=torch.tensor([3]),
        return_dict=False,
    )
    return model, inputs


@pytest.fixture
def vae():
    from diffusers import AutoencoderKL

    seeded(5)
    model = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    ).eval()
    seeded(6)
    return model, dict(sample=torch.randn(1, 3, 16, 16), return_dict=False)


@pytest.fixture
def clip():
    from transformers import CLIPTextConfig, CLIPTextModel

    seeded(7)
    model = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            max_position_embeddings=16,
        )
    ).eval()
    return model, dict(input_ids=torch.tensor([[1, 5, 9, 3, 2, 0]]), return_dict=False)


@pytest.fixture
def wan():
    """A Wan-2.1-shaped video transformer: some modules are kept in fp32 by Diffusers
    (``_keep_in_fp32_modules``) whatever ``torch_dtype`` says, and its rotary table is a buffer."""
    from diffusers import WanTransformer3DModel

    seeded(8)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=3,
        rope_max_seq_len=32,
    ).eval()
    seeded(9)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 1, 4, 4),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 16),
        return_dict=False,
    )
    return model, inputs
