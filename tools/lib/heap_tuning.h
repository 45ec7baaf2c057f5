// Process-wide tuning of the C library's heap for memsim's allocation pattern.
//
// Note [Keeping freed memory]
// A simulation builds event logs, storage tables and timelines of tens to hundreds of MB in
// vectors that grow by doubling and are dropped with the layout. glibc serves every block
// above its mmap threshold with a fresh mmap and unmaps it when it is freed (the threshold
// starts at 128 KiB and rises with the blocks freed, up to 32 MiB), and trims the heap's
// free top back to the system, so each doubling and each layout of a search touches new
// pages: perf put about a fifth of an in-process layout (memsim_bench's Llama-3-70B, 128
// microbatches, one thread) in page faults. Fixing the threshold at its 32 MiB ceiling and
// trimming only a free top above 256 MiB keeps the freed blocks below 32 MiB (most of a
// doubling vector's life, and most vectors) mapped for the next vector and the next layout;
// larger ones are still mapped fresh. Measured (single runs, A/B in one session): that in-process
// layout 391-406 -> 300-340 ms; `memsim plan` for Llama-3-70B on 64 GPUs 6.9 -> 6.0 s. The price is
// memory held between layouts, per thread's arena: the seeds' 24-layout sweep's peak RSS 750-810 MB
// -> 770-960 MB, plan's 974 -> 1124 MB (KB from `time -f %M`).
#pragma once

namespace memsim {

// Applies Note [Keeping freed memory]; a no-op on C libraries other than glibc.
// REQUIRES: called before the process allocates heavily (at the start of main).
void KeepFreedMemoryMapped();

}  // namespace memsim
