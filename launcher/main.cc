// dtrain-launch: see launcher/launcher.h.
#include <iostream>

#include "core/error.h"
#include "launcher/launcher.h"

int main(int argc, char** argv) {
  try {
    auto options = dtrain::launcher::parse_args(std::vector<std::string>(argv + 1, argv + argc));
    return dtrain::launcher::run(options);
  } catch (const dtrain::UsageError& e) {
    std::cerr << "dtrain-launch: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "dtrain-launch: " << e.what() << std::endl;
    return 1;
  }
}
