// The translation unit that precompiles the LibTorch headers (CMakeLists.txt, DTRAIN_PCH).
