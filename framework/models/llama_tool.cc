// llama_tool: dtrain's Llama against transformers' (tests/llama_hf_test.py).
//   llama_tool logits DIR TOKENS OUT [bf16]  loads the Hugging Face checkpoint in DIR, runs the
//                                            "tokens" tensor of the safetensors file TOKENS
//                                            through it (in bf16 when asked) and writes
//                                            "logits" (fp32) to OUT
//   llama_tool resave DIR OUT_DIR             loads DIR and saves it as dtrain does into OUT_DIR
// An error prints its message and exits 2.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <iostream>
#include <string>

#include "core/error.h"
#include "framework/checkpoint/safetensors.h"
#include "framework/models/llama.h"

int main(int argc, char** argv) {
  using namespace dtrain::framework;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "logits" && (argc == 5 || argc == 6)) || (mode == "resave" && argc == 4))) {
    std::cerr << "usage: llama_tool logits DIR TOKENS OUT [bf16] | resave DIR OUT_DIR\n";
    return 2;
  }
  try {
    LlamaForCausalLM m = load_hf_llama(argv[2]);
    if (mode == "resave") {
      save_hf_llama(*m, argv[3]);
      return 0;
    }
    if (argc == 6 && std::string(argv[5]) == "bf16") m->to(at::kBFloat16);
    at::Tensor tokens;
    for (const auto& [name, t] : ckpt::read_safetensors(argv[3]).tensors) {
      if (name == "tokens") tokens = t.to(at::kLong);
    }
    DTRAIN_CHECK_AS(dtrain::UsageError, tokens.defined(), argv[3], ": no tensor 'tokens'");
    c10::NoGradGuard no_grad;
    at::Tensor logits = m->forward(tokens).to(at::kFloat);
    ckpt::write_safetensors(argv[4], {{"logits", logits}});
  } catch (const dtrain::Error& e) {
    std::cerr << "llama_tool: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
