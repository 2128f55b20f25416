// The amx level's translation unit: model.cpp, built with this level's flags (../levels.py,
// setup.py). One file per level, so that each level's objects have paths of their own: the levels
// build side by side and one shared source would give them one object file.
#include "../model.cpp"
