// dtrain's version: the one place it is written. CMake reads it from here (project VERSION,
// dtrainConfigVersion.cmake); every binary prints it with --version.
#pragma once

#define DTRAIN_VERSION_MAJOR 0
#define DTRAIN_VERSION_MINOR 2
#define DTRAIN_VERSION_PATCH 0
#define DTRAIN_VERSION "0.2.0"
