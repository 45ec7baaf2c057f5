// Megatron-LM's per-layer patterns written as Python list expressions (arguments.py
// _eval_pattern: "([0]*3+[1]*1)*3" is [0,0,0,1,0,0,0,1,0,0,0,1]), evaluated without Python.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "simulator/status.h"

namespace memsim {

// The most elements a pattern may expand to (a layer count is far below it).
inline constexpr int64_t kMaxPatternElements = int64_t{1} << 20;

// Evaluates `text`, an expression of non-negative integers, lists [a, b, ...] of
// expressions that are integers, parentheses, + (integers add, lists concatenate, and a
// unary +), * (integers multiply, a list repeats) and ** (integers), as Python does, into a
// list of integers. Megatron allows only digits, commas, brackets, parentheses, + and * (no
// spaces); so does this. An error names the text and what is wrong: another character, a
// syntax error Python would raise too, a result that is not a list, or more than
// kMaxPatternElements elements (or a pattern too long or too costly to build).
Status EvaluateLayerPattern(const std::string& text, std::vector<int64_t>* out);

}  // namespace memsim
