#!/usr/bin/env python3
"""dtrain checkpoints and PyTorch, both ways (run by framework/checkpoint_test.cc).

  read STEP_DIR   loads STEP_DIR/model.pt into bench/reference/model.py's TransformerLM with
                  torch.load(weights_only=True) and load_state_dict(strict=True), and
                  STEP_DIR/scaler.pt into torch.amp.GradScaler; writes the model's logits on
                  a fixed input and the scaler's scale and growth tracker to STEP_DIR/python.pt
  write OUT_DIR   saves a fresh TransformerLM's state_dict() with torch.save, and its logits on
                  the same fixed input, to OUT_DIR/state_dict.pt and OUT_DIR/logits.pt
The model is the tiny configs' (vocab 256, seq_len 32, d_model 64, 2 layers, 4 heads, d_ff 256).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench",
                                "reference"))
from model import TransformerLM  # noqa: E402


def fixed_input():
    return torch.arange(2 * 32).reshape(2, 32).remainder(251)


def main():
    mode, path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    model = TransformerLM(256, 32, 64, 2, 4, 256)
    if mode == "read":
        state = torch.load(os.path.join(path, "model.pt"), weights_only=True)
        model.load_state_dict(state, strict=True)
        scaler_state = torch.load(os.path.join(path, "scaler.pt"), weights_only=True)
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(scaler_state)
        with torch.no_grad():
            logits = model(fixed_input())
        torch.save({"logits": logits, "scale": torch.tensor(scaler.get_scale()),
                    "growth_tracker": torch.tensor(scaler._get_growth_tracker())},
                   os.path.join(path, "python.pt"))
    elif mode == "write":
        torch.manual_seed(3)
        model = TransformerLM(256, 32, 64, 2, 4, 256)
        torch.save(model.state_dict(), os.path.join(path, "state_dict.pt"))
        with torch.no_grad():
            torch.save(model(fixed_input()), os.path.join(path, "logits.pt"))
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
