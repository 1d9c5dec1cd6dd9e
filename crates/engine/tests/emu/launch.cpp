// The grid launcher of the CPU emulation (see shim.h for what is and is not emulated).
// pd_emu_launch runs a kernel over a grid: blocks one after another, the threads of a block
// as real OS threads meeting at a std::barrier for __syncthreads(), one barrier per warp
// for the shuffles. The kernel call itself is the `body` callback (the test, in Rust,
// calls the kernel symbol with its arguments), run once per CUDA thread.
#include "shim.h"

#include <barrier>
#include <memory>
#include <thread>
#include <vector>

thread_local pd_emu_dim3 threadIdx, blockIdx;
pd_emu_dim3 blockDim, gridDim;

namespace {
std::barrier<>* g_block_barrier = nullptr;
std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
float g_shfl[1024];
}  // namespace

extern "C" void pd_emu_syncthreads(void) { g_block_barrier->arrive_and_wait(); }

extern "C" float pd_emu_shfl_xor_f32(float v, int lane_mask) {
    unsigned t = threadIdx.x;
    std::barrier<>& b = *g_warp_barriers[t / 32];
    g_shfl[t] = v;
    b.arrive_and_wait();  // every lane has published
    unsigned src = (t & ~31u) | ((t & 31u) ^ (unsigned)lane_mask);
    float r = src < blockDim.x ? g_shfl[src] : v;
    b.arrive_and_wait();  // every lane has read before the buffer is reused
    return r;
}

// Returns 0, or -1 for a launch shape a CUDA device would refuse.
extern "C" int pd_emu_launch(unsigned gx, unsigned gy, unsigned block, void (*body)(void*), void* ctx) {
    if (gx == 0 || gy == 0 || block == 0 || block > 1024) return -1;
    gridDim = {gx, gy, 1};
    blockDim = {block, 1, 1};
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bx = 0; bx < gx; bx++) {
            std::barrier<> bar((std::ptrdiff_t)block);
            g_block_barrier = &bar;
            g_warp_barriers.clear();
            for (unsigned w = 0; w < (block + 31) / 32; w++)
                g_warp_barriers.emplace_back(new std::barrier<>((std::ptrdiff_t)std::min(32u, block - 32 * w)));
            std::vector<std::thread> threads;
            threads.reserve(block);
            for (unsigned t = 0; t < block; t++)
                threads.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    body(ctx);
                    // A finished thread no longer holds up its warp's or block's barriers.
                    g_warp_barriers[t / 32]->arrive_and_drop();
                    bar.arrive_and_drop();
                });
            for (auto& th : threads) th.join();
        }
    return 0;
}
