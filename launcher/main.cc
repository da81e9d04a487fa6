// dtrain-launch: see launcher/launcher.h.
#include <exception>
#include <iostream>

#include "core/cli.h"
#include "core/error.h"
#include "launcher/launcher.h"

int main(int argc, char** argv) {
  try {
    auto options = dtrain::launcher::parse_args(std::vector<std::string>(argv + 1, argv + argc));
    if (!options.print_and_exit.empty()) {
      std::cout << options.print_and_exit << std::endl;
      return 0;
    }
    return dtrain::launcher::run(options);
  } catch (...) {
    auto failure = dtrain::cli::failure_of(std::current_exception());
    std::cerr << "dtrain-launch: " << failure.message << std::endl;
    return failure.code;
  }
}
