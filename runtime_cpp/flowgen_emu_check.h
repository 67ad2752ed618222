// flowgen_emu_check.h: the emulator's checking mode (FLOWGEN_EMULATOR_CHECK=1, which builds
// kernels with -DFLOWGEN_EMU_CHECK -fsanitize=thread). It reports what compute-sanitizer or the
// hardware would, naming the kernel, the block, the thread and the address, and fails the launch:
//   * shared-memory races: two threads of a block touch a byte, at least one writes, and no
//     __syncthreads (or, within a warp, no __syncwarp) orders them;
//   * barriers not reached by every thread: threads of a block at different __syncthreads, a
//     thread that exits while others wait at one, barriers that can never complete;
//   * misaligned accesses (a 2-, 4-, 8- or 16-byte access the type says is aligned), cp.async and
//     ldmatrix addresses that are misaligned or outside shared memory;
//   * shared-memory accesses outside the kernel's static variables or its dynamic allocation;
//   * reads of wgmma accumulators before the wgmma_wait_group that retires their MMA, wgmma
//     descriptors that differ within a warpgroup, generic-proxy writes that a wgmma reads with no
//     fence.proxy.async by their writer before the barrier that publishes them;
//   * cp.async copies and wgmma operand reads are in flight from issue to wait: any other access
//     to their bytes meanwhile is a race, and each lands (or reads) at a random point between
//     issue and wait (seeded by FLOWGEN_EMULATOR_CHECK_SEED), so a racy kernel's numbers vary too;
//   * more than 48 KB of static or 227 KB of shared memory per block, more than 1024 threads.
//
// How accesses are seen: g++'s ThreadSanitizer instrumentation (-fsanitize=thread) calls
// __tsan_read4(addr), __tsan_write16(addr), __tsan_atomic32_fetch_add(...), ... before every
// memory access of the kernel code; this file defines those entry points itself (the library is
// linked without libtsan) and keeps a shadow of every shared-memory byte: its last writer and up
// to two readers, each with the barrier interval and warp epoch of the access. Blocks run one at
// a time, every kernel's threads as fibers, and `__shared__` variables are plain statics in the
// section `flowgen_shared`, whose symbols (read from the library's own ELF symbol table) give each
// kernel's variables and their bounds; the link script flowgen_emu_check.ld puts 512 guard bytes
// on either side of the section.
//
// The first report stops the block (its fibers are abandoned) and the launch; the Python runtime
// (CpuModule) collects it and raises. Without a collector (a standalone program) the report is
// printed and the process aborts.
#pragma once

#include <dlfcn.h>
#include <elf.h>

#include <cstdarg>
#include <mutex>
#include <string>

// Functions of the checker run uninstrumented.
#define FLOWGEN_EMU_QUIET __attribute__((no_sanitize_thread))

namespace flowgen_emu {
namespace check {

constexpr size_t kStaticSharedLimit = 48 * 1024;    // what a kernel may declare statically
constexpr size_t kSharedLimit = 227 * 1024;         // an sm_90 block's shared memory, opted in
constexpr int kMaxThreads = 1024;
constexpr size_t kDynamicGuard = 1024;              // guard bytes on either side of dynamic shared memory

// A `__shared__` variable: its bytes and the kernel it belongs to ("" when it is declared in a
// device function, which any kernel may call).
struct SharedVariable {
  uintptr_t begin, end;
  std::string name, kernel;
};

// The shadow of one shared-memory byte. Intervals number the stretches between block barriers
// (globally, so a record from an earlier block is always older than the current one); an epoch
// numbers a warp's __syncwarp barriers.
struct Shadow {
  uint32_t write_interval = 0, write_epoch = 0, write_fences = 0;
  int16_t writer = -1;
  int16_t async_writer = -1;   // a thread whose cp.async to this byte is in flight
  uint32_t read_interval = 0;
  int16_t reader[2] = {-1, -1};
  uint32_t reader_epoch[2] = {0, 0};
  bool reader_wgmma[2] = {false, false};  // the read was a wgmma's (counted from its wait)
  uint16_t async_reads = 0;    // wgmma operand reads of this byte in flight
};

enum class Wait : uint8_t { kRunning, kBlockBarrier, kWarpBarrier };

struct ThreadState {
  Wait wait = Wait::kRunning;
  uint32_t generation = 0;     // of the barrier it waits at
  uint32_t fences = 0;         // fence.proxy.async executed
  uint32_t fences_at_sync = 0; // ... when it last arrived at a barrier
  uint32_t wgmma_issued = 0;
  uintptr_t accumulators_begin = 0, accumulators_end = 0;  // of its wgmma in flight (a bounding box)
};

struct Barrier {
  int arrived = 0, line = 0, first = -1;
  uint32_t generation = 0;
  bool orders_memory = true;  // (a warp's) every lane arrived through __syncwarp
};

// What one wgmma.mma_async of a warpgroup must agree on across its 128 threads.
struct WgmmaSignature {
  uint64_t a_desc, b_desc;
  int n, k, scale_d, trans_a, trans_b, thread;
};

struct Checker {
  bool collect = false;        // a caller (CpuModule) takes the reports; else print and abort
  bool active = false;         // a checked block is running
  bool failed = false;
  std::string report;
  const char* kernel = "";
  unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1};
  Block* running = nullptr;
  // Static shared memory: the section (guards included) and its variables, sorted by address.
  bool variables_read = false;
  uintptr_t static_begin = 0, static_end = 0;
  std::vector<SharedVariable> variables;
  std::vector<Shadow> static_shadow;
  const SharedVariable* last_variable = nullptr;
  // Dynamic shared memory of the launch, and its guards.
  uintptr_t dynamic_begin = 0, dynamic_guarded_begin = 0, dynamic_guarded_end = 0;
  size_t dynamic_bytes = 0;
  std::vector<Shadow> dynamic_shadow;
  // The running block.
  uint32_t interval = 1, block_start = 1;
  std::vector<ThreadState> threads;
  std::vector<uint32_t> warp_epoch;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<int> live_lanes;
  int exited = 0, first_exited = -1;
  std::vector<std::vector<WgmmaSignature>> signatures;   // per warpgroup, by issue index
  uint64_t seed = 0, random = 0;
  // The vectors' data, for the hot path: a std::vector member function is a call into
  // instrumented code from here (g++ does not inline across sanitizer attributes).
  ThreadState* states = nullptr;
  uint32_t* epochs = nullptr;
  Shadow* static_shadow_data = nullptr;
  Shadow* dynamic_shadow_data = nullptr;
  bool inside = false;         // an entry point is running: accesses of the checker's own code pass
  std::mutex launching;        // the checker serves one launch at a time
};
inline Checker checker __attribute__((visibility("hidden")));

// ---------------------------------------------------------------------------------------
// Reports.

FLOWGEN_EMU_QUIET inline std::string thread_name(int t) {
  const Checker& c = checker;
  const unsigned x = c.block[0], y = c.block[1];
  char text[96];
  std::snprintf(text, sizeof text, "thread (%u, %u, %u) [warp %d lane %d]", t % x, t / x % y, t / (x * y), t / 32,
                t % 32);
  return text;
}

FLOWGEN_EMU_QUIET inline std::string block_name() {
  char text[64];
  std::snprintf(text, sizeof text, "block (%u, %u, %u)", blockIdx.x, blockIdx.y, blockIdx.z);
  return text;
}

// Where an address is: a shared variable (and the offset in it), dynamic shared memory, or memory.
FLOWGEN_EMU_QUIET inline std::string describe(uintptr_t a) {
  Checker& c = checker;
  char text[256];
  if (c.dynamic_guarded_end && a >= c.dynamic_guarded_begin && a < c.dynamic_guarded_end) {
    const long long offset = (long long)(a - c.dynamic_begin);
    std::snprintf(text, sizeof text, "address %#llx: dynamic shared memory + %lld (shared-window address %lld) of "
                  "%zu bytes", (unsigned long long)a, offset, offset + (long long)kDynamicSharedAddress,
                  c.dynamic_bytes);
    return text;
  }
  if (a >= c.static_begin && a < c.static_end) {
    // The variable at `a`, and the running kernel's variables just before and after it.
    const SharedVariable *at = nullptr, *before = nullptr, *after = nullptr;
    for (const SharedVariable& v : c.variables) {
      const bool mine = v.kernel.empty() || v.kernel == c.kernel;
      if (a >= v.begin && a < v.end) at = &v;
      if (mine && v.end <= a && (!before || v.end > before->end)) before = &v;
      if (mine && v.begin > a && (!after || v.begin < after->begin)) after = &v;
    }
    if (at && (at->kernel.empty() || at->kernel == c.kernel)) {
      std::snprintf(text, sizeof text, "address %#llx: static shared `%s` + %llu (of %llu bytes)",
                    (unsigned long long)a, at->name.c_str(), (unsigned long long)(a - at->begin),
                    (unsigned long long)(at->end - at->begin));
      return text;
    }
    std::string where = "static shared memory";
    char part[160];
    if (before) {
      std::snprintf(part, sizeof part, ", %llu bytes past the end of `%s`", (unsigned long long)(a - before->end),
                    before->name.c_str());
      where += part;
    } else if (after) {
      std::snprintf(part, sizeof part, ", %llu bytes before `%s`", (unsigned long long)(after->begin - a),
                    after->name.c_str());
      where += part;
    }
    if (at) where += ", inside `" + at->name + "` of another kernel";
    std::snprintf(text, sizeof text, "address %#llx: %s", (unsigned long long)a, where.c_str());
    return text;
  }
  std::snprintf(text, sizeof text, "address %#llx", (unsigned long long)a);
  return text;
}

// Stops the block: the running fiber switches to the block's scheduler and is never resumed.
[[noreturn]] FLOWGEN_EMU_QUIET inline void bail() {
  Checker& c = checker;
  Block& b = *c.running;
  c.active = false;
  c.inside = false;
  switch_context(b.pool[b.current]->context, b.scheduler);
  __builtin_unreachable();
}

FLOWGEN_EMU_QUIET inline void record(const char* fmt, va_list args) {
  Checker& c = checker;
  if (c.failed) return;
  char what[512];
  std::vsnprintf(what, sizeof what, fmt, args);
  c.failed = true;
  c.report = std::string("flowgen emulator check: ") + what + "\n  in kernel " + c.kernel;
}

// A hazard of the running thread at `address` (0: none): recorded with the kernel, block,
// thread and address, then the block stops.
[[noreturn]] FLOWGEN_EMU_QUIET __attribute__((format(printf, 2, 3))) inline void hazard(uintptr_t address, const char* fmt, ...) {
  Checker& c = checker;
  va_list args;
  va_start(args, fmt);
  record(fmt, args);
  va_end(args);
  c.report += ", " + block_name() + ", " + thread_name(c.running->current);
  if (address) c.report += ", " + describe(address);
  bail();
}

// A launch the hardware would refuse: recorded before any block runs.
FLOWGEN_EMU_QUIET __attribute__((format(printf, 1, 2))) inline void refuse(const char* fmt, ...) {
  Checker& c = checker;
  va_list args;
  va_start(args, fmt);
  record(fmt, args);
  va_end(args);
  char where[96];
  std::snprintf(where, sizeof where, " (grid %u x %u x %u, block %u x %u x %u)", c.grid[0], c.grid[1], c.grid[2],
                c.block[0], c.block[1], c.block[2]);
  c.report += where;
}

// ---------------------------------------------------------------------------------------
// Static shared memory: the section's bounds come from the linker (__start_/__stop_, weak: a
// library without `__shared__` variables has no section), its variables from the ELF symbol
// table of the file this code was loaded from.

extern "C" char __start_flowgen_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_flowgen_shared[] __attribute__((weak, visibility("hidden")));

// The kernel a function-local static belongs to: `_ZZ<length><name>E<variable>` is a local
// static of the extern "C" function <name>; other functions' locals (`_ZZ3fooiE...`) belong to
// no kernel in particular.
FLOWGEN_EMU_QUIET inline void name_variable(SharedVariable& v, const char* symbol) {
  v.name = symbol;
  const char* s = symbol;
  if (std::strncmp(s, "_ZZ", 3) != 0) return;
  s += 3;
  char* end = nullptr;
  const long length = std::strtol(s, &end, 10);
  if (length <= 0 || end == s || std::strlen(end) < size_t(length) + 1 || end[length] != 'E') return;
  v.kernel.assign(end, size_t(length));
  const char* variable = end + length + 1;
  const long variable_length = std::strtol(variable, &end, 10);
  if (variable_length > 0 && std::strlen(end) >= size_t(variable_length))
    v.name = v.kernel + "::" + std::string(end, size_t(variable_length));
}

FLOWGEN_EMU_QUIET inline void read_variables() {
  Checker& c = checker;
  c.variables_read = true;
  c.static_begin = reinterpret_cast<uintptr_t>(__start_flowgen_shared);
  c.static_end = reinterpret_cast<uintptr_t>(__stop_flowgen_shared);
  if (!c.static_begin || c.static_end <= c.static_begin) {
    c.static_begin = c.static_end = 0;
    return;
  }
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&read_variables), &info) || !info.dli_fname) return;
  std::FILE* f = std::fopen(info.dli_fname, "rb");
  if (!f) return;
  std::vector<unsigned char> file;
  unsigned char chunk[65536];
  for (size_t n; (n = std::fread(chunk, 1, sizeof chunk, f)) > 0;) file.insert(file.end(), chunk, chunk + n);
  std::fclose(f);
  if (file.size() < sizeof(Elf64_Ehdr)) return;
  Elf64_Ehdr header;
  std::memcpy(&header, file.data(), sizeof header);
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 || header.e_ident[EI_CLASS] != ELFCLASS64) return;
  if (header.e_shoff + size_t(header.e_shnum) * sizeof(Elf64_Shdr) > file.size()) return;
  std::vector<Elf64_Shdr> sections(header.e_shnum);
  std::memcpy(sections.data(), file.data() + header.e_shoff, sections.size() * sizeof(Elf64_Shdr));
  const Elf64_Shdr& names = sections[header.e_shstrndx];
  int shared_index = -1, symtab_index = -1;
  for (int i = 0; i < int(sections.size()); ++i) {
    const char* name = reinterpret_cast<const char*>(file.data() + names.sh_offset + sections[i].sh_name);
    if (std::strcmp(name, "flowgen_shared") == 0) shared_index = i;
    if (sections[i].sh_type == SHT_SYMTAB) symtab_index = i;
  }
  if (shared_index < 0 || symtab_index < 0) return;
  const Elf64_Shdr& symtab = sections[symtab_index];
  const Elf64_Shdr& strtab = sections[symtab.sh_link];
  const uintptr_t bias = header.e_type == ET_DYN ? reinterpret_cast<uintptr_t>(info.dli_fbase) : 0;
  for (size_t at = symtab.sh_offset; at + sizeof(Elf64_Sym) <= symtab.sh_offset + symtab.sh_size;
       at += sizeof(Elf64_Sym)) {
    Elf64_Sym symbol;
    std::memcpy(&symbol, file.data() + at, sizeof symbol);
    if (symbol.st_shndx != shared_index || ELF64_ST_TYPE(symbol.st_info) != STT_OBJECT || symbol.st_size == 0)
      continue;
    SharedVariable v;
    v.begin = bias + symbol.st_value;
    v.end = v.begin + symbol.st_size;
    name_variable(v, reinterpret_cast<const char*>(file.data() + strtab.sh_offset + symbol.st_name));
    c.variables.push_back(std::move(v));
  }
  std::sort(c.variables.begin(), c.variables.end(),
            [](const SharedVariable& x, const SharedVariable& y) { return x.begin < y.begin; });
  c.static_shadow.assign(c.static_end - c.static_begin, Shadow{});
  c.static_shadow_data = c.static_shadow.data();
}

// The static variable holding [a, a + n) if the running kernel may touch it, else null.
FLOWGEN_EMU_QUIET inline const SharedVariable* variable_of(uintptr_t a, size_t n) {
  Checker& c = checker;
  const SharedVariable* v = c.last_variable;
  if (!(v && a >= v->begin && a < v->end)) {
    auto after = std::upper_bound(c.variables.begin(), c.variables.end(), a,
                                  [](uintptr_t x, const SharedVariable& y) { return x < y.begin; });
    if (after == c.variables.begin()) return nullptr;
    v = &*(after - 1);
    if (a >= v->end) return nullptr;
  }
  if (a + n > v->end || !(v->kernel.empty() || v->kernel == c.kernel)) return nullptr;
  c.last_variable = v;
  return v;
}

// ---------------------------------------------------------------------------------------
// The shadow.

enum class Access : uint8_t { kRead, kWrite, kAtomic };

FLOWGEN_EMU_QUIET inline const char* access_name(Access kind) {
  return kind == Access::kRead ? "reads" : kind == Access::kWrite ? "writes" : "atomically updates";
}

// The shadow of shared-memory bytes [a, a + n) for the running kernel; null when they are not
// shared memory. Bytes of shared memory the kernel does not own are reported.
FLOWGEN_EMU_QUIET inline Shadow* shadow_of(uintptr_t a, size_t n, const char* what) {
  Checker& c = checker;
  if (a - c.static_begin < c.static_end - c.static_begin) {
    if (!variable_of(a, n))
      hazard(a, "%s %zu bytes outside the kernel's static shared memory", what, n);
    return &c.static_shadow_data[a - c.static_begin];
  }
  if (a - c.dynamic_guarded_begin < c.dynamic_guarded_end - c.dynamic_guarded_begin) {
    if (a < c.dynamic_begin || a + n > c.dynamic_begin + c.dynamic_bytes)
      hazard(a, "%s %zu bytes outside the %zu bytes of dynamic shared memory", what, n, c.dynamic_bytes);
    return &c.dynamic_shadow_data[a - c.dynamic_begin];
  }
  return nullptr;
}

FLOWGEN_EMU_QUIET inline bool in_shared_memory(uintptr_t a) {
  const Checker& c = checker;
  return a - c.static_begin < c.static_end - c.static_begin ||
         a - c.dynamic_guarded_begin < c.dynamic_guarded_end - c.dynamic_guarded_begin;
}

// Whether an access by thread `t` in (interval, epoch) happens before what the running thread
// `u` does now: a block barrier since, the same thread, or a __syncwarp of their warp since.
FLOWGEN_EMU_QUIET inline bool ordered(int t, uint32_t interval, uint32_t epoch, int u) {
  const Checker& c = checker;
  return interval < c.interval || t == u || (t / 32 == u / 32 && epoch < c.epochs[u / 32]);
}

FLOWGEN_EMU_QUIET inline void check_in_flight(const Shadow& s, uintptr_t a, const char* what) {
  if (s.async_writer >= 0)
    hazard(a, "%s shared memory that a cp.async of %s still writes (no cp.async.wait_group retired it)", what,
           thread_name(s.async_writer).c_str());
}

// The running thread reads (kRead) or writes (kWrite) byte `a` with shadow `s`.
FLOWGEN_EMU_QUIET inline void read_byte(Shadow& s, uintptr_t a, int u, const char* what, bool wgmma = false) {
  Checker& c = checker;
  check_in_flight(s, a, what);
  if (s.write_interval >= c.block_start && !ordered(s.writer, s.write_interval, s.write_epoch, u))
    hazard(a, "read-after-write race: %s shared memory that %s wrote with no barrier between", what,
           thread_name(s.writer).c_str());
  const uint32_t epoch = c.epochs[u / 32];
  if (s.read_interval != c.interval) {
    s.read_interval = c.interval;
    s.reader[0] = int16_t(u), s.reader_epoch[0] = epoch, s.reader_wgmma[0] = wgmma;
    s.reader[1] = -1;
  } else if (s.reader[0] == u) {
    s.reader_epoch[0] = epoch, s.reader_wgmma[0] = wgmma;
  } else {  // keep the two latest distinct readers: a later writer differs from at least one
    s.reader[1] = s.reader[0], s.reader_epoch[1] = s.reader_epoch[0], s.reader_wgmma[1] = s.reader_wgmma[0];
    s.reader[0] = int16_t(u), s.reader_epoch[0] = epoch, s.reader_wgmma[0] = wgmma;
  }
}

FLOWGEN_EMU_QUIET inline void check_write_byte(const Shadow& s, uintptr_t a, int u, const char* what) {
  const Checker& c = checker;
  check_in_flight(s, a, what);
  if (s.async_reads)
    hazard(a, "write-after-read race: %s shared memory that a wgmma in flight reads (its warpgroup has not "
              "retired it with wgmma_wait_group)", what);
  if (s.write_interval >= c.block_start && !ordered(s.writer, s.write_interval, s.write_epoch, u))
    hazard(a, "write-after-write race: %s shared memory that %s wrote with no barrier between", what,
           thread_name(s.writer).c_str());
  if (s.read_interval == c.interval)
    for (int r = 0; r < 2; ++r)
      if (s.reader[r] >= 0 && !ordered(s.reader[r], s.read_interval, s.reader_epoch[r], u))
        hazard(a, "write-after-read race: %s shared memory that %s with no barrier between", what,
               (s.reader_wgmma[r] ? "a wgmma read, retired by the wgmma_wait_group of " + thread_name(s.reader[r])
                                  : thread_name(s.reader[r]) + " read").c_str());
}

FLOWGEN_EMU_QUIET inline void write_byte(Shadow& s, int u) {
  Checker& c = checker;
  s.writer = int16_t(u);
  s.write_interval = c.interval;
  s.write_epoch = c.epochs[u / 32];
  s.write_fences = c.states[u].fences;
  s.read_interval = 0;
}

FLOWGEN_EMU_QUIET inline bool accumulators_in_flight(uintptr_t a, size_t n);

// Every instrumented access of kernel code comes here.
FLOWGEN_EMU_QUIET inline void on_access(const volatile void* p, size_t n, Access kind, bool typed_aligned) {
  Checker& c = checker;
  if (!c.active) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const int u = c.running->current;
  if (typed_aligned && n > 1 && (a & (n - 1)))
    hazard(a, "misaligned %zu-byte access: the thread %s an address that is not a multiple of %zu", n,
           access_name(kind), n);
  const ThreadState& me = c.states[u];
  if (a < me.accumulators_end && a + n > me.accumulators_begin && accumulators_in_flight(a, n))
    hazard(a, "the thread %s wgmma accumulators before wgmma_wait_group retired the MMA that writes them",
           access_name(kind));
  Shadow* s = shadow_of(a, n, kind == Access::kRead ? "the thread reads" : "the thread writes");
  if (!s || kind == Access::kAtomic) return;
  for (size_t i = 0; i < n; ++i) {
    if (kind == Access::kRead) {
      read_byte(s[i], a + i, u, "the thread reads");
    } else {
      check_write_byte(s[i], a + i, u, "the thread writes");
      write_byte(s[i], u);
    }
  }
}

// The entry points' way in: the checker's own code (a std::vector member function it calls, which
// g++ instruments) passes unchecked.
FLOWGEN_EMU_QUIET inline void checked_access(const volatile void* p, size_t n, Access kind, bool typed_aligned) {
  Checker& c = checker;
  if (!c.active || c.inside) return;
  c.inside = true;
  on_access(p, n, kind, typed_aligned);
  c.inside = false;
}

// A vector type (float2, float4) copied from (or to) memory at p: one access of its whole size.
FLOWGEN_EMU_QUIET inline void vector_access(const void* p, size_t bytes, bool write) {
  checked_access(p, bytes, write ? Access::kWrite : Access::kRead, true);
}

// ---------------------------------------------------------------------------------------
// Launches and blocks.

FLOWGEN_EMU_QUIET inline uint64_t next_random() {  // splitmix64
  uint64_t z = (checker.random += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
FLOWGEN_EMU_QUIET inline bool coin() { return next_random() & 1; }

// False when the hardware would refuse the launch.
FLOWGEN_EMU_QUIET inline bool begin_launch(const char* kernel, const unsigned* grid, const unsigned* block, size_t dynamic_bytes) {
  Checker& c = checker;
  if (!c.variables_read) read_variables();
  c.kernel = kernel;
  std::memcpy(c.grid, grid, sizeof c.grid);
  std::memcpy(c.block, block, sizeof c.block);
  c.last_variable = nullptr;
  const char* seed = std::getenv("FLOWGEN_EMULATOR_CHECK_SEED");
  c.seed = seed ? std::strtoull(seed, nullptr, 10) : 0;
  size_t static_bytes = 0;
  for (const SharedVariable& v : c.variables)
    if (v.kernel == kernel) static_bytes += v.end - v.begin;
  const long long threads = (long long)block[0] * block[1] * block[2];
  if (threads > kMaxThreads)
    refuse("a block of %lld threads: a block has at most %d", threads, kMaxThreads);
  else if (static_bytes > kStaticSharedLimit)
    refuse("%zu bytes of static shared memory: a kernel may declare at most 48 KB (%zu bytes)", static_bytes,
           kStaticSharedLimit);
  else if (static_bytes + dynamic_bytes > kSharedLimit)
    refuse("%zu bytes of shared memory per block (%zu static, %zu dynamic): an sm_90 block has at most 227 KB "
           "(%zu bytes)", static_bytes + dynamic_bytes, static_bytes, dynamic_bytes, kSharedLimit);
  return !c.failed;
}

FLOWGEN_EMU_QUIET inline void begin_block(Block& b, long long linear_block) {
  Checker& c = checker;
  const int n = b.nthreads, warps = (n + 31) / 32;
  c.running = &b;
  c.random = c.seed * 0x2545F4914F6CDD1Dull + uint64_t(linear_block);
  c.block_start = ++c.interval;
  c.threads.assign(n, ThreadState{});
  c.states = c.threads.data();
  c.warp_epoch.assign(warps, 0);
  c.epochs = c.warp_epoch.data();
  c.block_barrier = Barrier{};
  c.warp_barriers.assign(warps, Barrier{});
  c.live_lanes.assign(warps, 0);
  for (int t = 0; t < n; ++t) ++c.live_lanes[t / 32];
  c.exited = 0, c.first_exited = -1;
  c.signatures.assign((n + 127) / 128, {});
  c.dynamic_begin = reinterpret_cast<uintptr_t>(b.dynamic_base);
  c.dynamic_bytes = b.dynamic_bytes;
  c.dynamic_guarded_begin = c.dynamic_begin - kDynamicGuard;
  c.dynamic_guarded_end = c.dynamic_begin + b.dynamic_bytes + kDynamicGuard;
  if (c.dynamic_shadow.size() < b.dynamic_bytes) c.dynamic_shadow.resize(b.dynamic_bytes);
  c.dynamic_shadow_data = c.dynamic_shadow.data();
  c.inside = false;
  c.active = true;
}

// The block has finished or stopped. Copies and MMAs it left in flight leave the shadow.
FLOWGEN_EMU_QUIET inline void end_block(Block& b) {
  Checker& c = checker;
  c.active = false;
  c.inside = false;
  bool in_flight = c.failed;
  for (int t = 0; t < b.nthreads && !in_flight; ++t) {
    if (b.async_used) in_flight = !b.async_copies[t].open.empty() || !b.async_copies[t].groups.empty();
    if (b.wgmma_used && !in_flight) in_flight = !b.wgmma[t].open.empty() || !b.wgmma[t].groups.empty();
  }
  if (!in_flight) return;
  for (Shadow* shadow : {c.static_shadow_data, c.dynamic_shadow_data}) {
    const size_t n = shadow == c.static_shadow_data ? c.static_shadow.size() : c.dynamic_shadow.size();
    for (size_t i = 0; i < n; ++i) shadow[i].async_writer = -1, shadow[i].async_reads = 0;
  }
}

// After the launch: without a collector a report ends the process, as a failed launch ends a CUDA
// program's context.
FLOWGEN_EMU_QUIET inline void end_launch() {
  Checker& c = checker;
  c.active = false;
  if (c.failed && !c.collect) {
    std::fprintf(stderr, "%s\n", c.report.c_str());
    std::abort();
  }
}

// ---------------------------------------------------------------------------------------
// Scheduling: fibers run round-robin; a thread waiting at a barrier runs again once the
// barrier's generation has moved on.

FLOWGEN_EMU_QUIET inline bool runnable(const Block& b, int t) {
  const Checker& c = checker;
  if (b.done[t]) return false;
  const ThreadState& s = c.states[t];
  switch (s.wait) {
    case Wait::kRunning: return true;
    case Wait::kBlockBarrier: return s.generation != c.block_barrier.generation;
    case Wait::kWarpBarrier: return s.generation != c.warp_barriers[t / 32].generation;
  }
  return false;
}

FLOWGEN_EMU_QUIET inline void land_some(Block& b, int t);

// No thread can run, yet some have not finished: a barrier that cannot complete.
[[noreturn]] FLOWGEN_EMU_QUIET inline void deadlock(Block& b) {
  Checker& c = checker;
  int at_block = -1, at_warp = -1;
  for (int t = 0; t < b.nthreads; ++t) {
    if (b.done[t]) continue;
    if (c.states[t].wait == Wait::kBlockBarrier && at_block < 0) at_block = t;
    if (c.states[t].wait == Wait::kWarpBarrier && at_warp < 0) at_warp = t;
  }
  b.current = at_block >= 0 ? at_block : at_warp;
  if (at_block >= 0 && at_warp >= 0)
    hazard(0, "barrier not reached by every thread: the thread waits at __syncthreads (line %d) while %s waits at "
              "a warp-synchronous operation (__syncwarp, a shuffle, a vote, mma or ldmatrix)",
           c.block_barrier.line, thread_name(at_warp).c_str());
  hazard(0, "a warp-synchronous operation (__syncwarp, a shuffle, a vote, mma or ldmatrix) that the other live "
            "lanes of the warp never reach");
}

// Runs the next runnable thread after `me` (cyclically, `me` last); returns when `me` runs again.
FLOWGEN_EMU_QUIET inline void schedule(Block& b, int me) {
  const int n = b.nthreads;
  for (int k = 1; k <= n; ++k) {
    const int t = (me + k) % n;
    if (!runnable(b, t)) continue;
    if (t != me) {
      b.current = t;
      switch_context(b.pool[me]->context, b.pool[t]->context);
      become_thread(b, me);
    }
    checker.states[me].wait = Wait::kRunning;
    land_some(b, me);
    return;
  }
  for (int t = 0; t < n; ++t)
    if (!b.done[t]) deadlock(b);
  switch_context(b.pool[me]->context, b.scheduler);  // every thread of the block has finished
}

FLOWGEN_EMU_QUIET inline void complete_block_barrier() {
  Checker& c = checker;
  c.block_barrier.arrived = 0;
  ++c.block_barrier.generation;
  ++c.interval;
}

FLOWGEN_EMU_QUIET inline void block_barrier(int line) {
  Checker& c = checker;
  Block& b = *c.running;
  const int u = b.current;
  Barrier& bar = c.block_barrier;
  if (c.exited > 0)
    hazard(0, "barrier not reached by every thread: the thread reaches __syncthreads (line %d), which %s never "
              "reaches (it has exited)", line, thread_name(c.first_exited).c_str());
  if (bar.arrived == 0) {
    bar.line = line, bar.first = u;
  } else if (bar.line != line) {
    hazard(0, "barrier not reached by every thread: the thread reaches __syncthreads at line %d while %s waits at "
              "the __syncthreads at line %d", line, thread_name(bar.first).c_str(), bar.line);
  }
  ThreadState& me = c.states[u];
  me.fences_at_sync = me.fences;
  me.wait = Wait::kBlockBarrier;
  me.generation = bar.generation;
  if (++bar.arrived == b.nthreads) complete_block_barrier();
  schedule(b, u);
}

FLOWGEN_EMU_QUIET inline void complete_warp_barrier(int warp) {
  Checker& c = checker;
  Barrier& bar = c.warp_barriers[warp];
  if (bar.orders_memory) ++c.epochs[warp];
  bar.arrived = 0;
  bar.orders_memory = true;
  ++bar.generation;
}

// A warp-synchronous operation: it waits for the warp's lanes that have not exited (PTX ISA:
// the *.sync instructions wait for the non-exited threads of their member mask). Only __syncwarp
// orders the lanes' memory accesses (CUDA C++ Programming Guide: __syncwarp "guarantees memory
// ordering among threads participating in the barrier"); shuffles, votes, mma and ldmatrix
// exchange registers and order nothing.
FLOWGEN_EMU_QUIET inline void warp_barrier(bool orders_memory) {
  Checker& c = checker;
  Block& b = *c.running;
  const int u = b.current, warp = u / 32;
  ThreadState& me = c.states[u];
  Barrier& bar = c.warp_barriers[warp];
  if (orders_memory) me.fences_at_sync = me.fences;
  me.wait = Wait::kWarpBarrier;
  me.generation = bar.generation;
  bar.orders_memory = bar.orders_memory && orders_memory;
  if (++bar.arrived == c.live_lanes[warp]) complete_warp_barrier(warp);
  schedule(b, u);
}

// A thread returns from the kernel. A block barrier with arrivals can no longer be reached by
// every thread (__syncthreads is bar.sync.aligned: all threads execute it or none).
FLOWGEN_EMU_QUIET inline void thread_exit(Block& b, int t) {
  Checker& c = checker;
  if (c.block_barrier.arrived > 0)
    hazard(0, "barrier not reached by every thread: the thread exits while %s waits at the __syncthreads at "
              "line %d", thread_name(c.block_barrier.first).c_str(), c.block_barrier.line);
  b.done[t] = 1;
  if (c.exited++ == 0) c.first_exited = t;
  const int warp = t / 32;
  if (--c.live_lanes[warp] > 0 && c.warp_barriers[warp].arrived == c.live_lanes[warp]) complete_warp_barrier(warp);
  schedule(b, t);
}

// ---------------------------------------------------------------------------------------
// Asynchronous copies and warpgroup MMA.

FLOWGEN_EMU_QUIET inline void check_alignment(uintptr_t a, size_t alignment, const char* what) {
  if (a % alignment) hazard(a, "misaligned %s: the address is not a multiple of %zu", what, alignment);
}

// ldmatrix: this lane's row address (lanes 0 .. 8 x matrices - 1 give one each).
FLOWGEN_EMU_QUIET inline void ldmatrix_row(const void* row, int matrices) {
  Checker& c = checker;
  const int u = c.running->current;
  if (u % 32 >= 8 * matrices) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(row);
  if (!in_shared_memory(a)) hazard(a, "ldmatrix row address outside shared memory");
  check_alignment(a, 16, "ldmatrix row address");
  Shadow* s = shadow_of(a, 16, "ldmatrix reads");
  for (int i = 0; i < 16; ++i) read_byte(s[i], a + i, u, "ldmatrix reads");
}

FLOWGEN_EMU_QUIET inline void cp_async_issue(void* dst, const void* src, int bytes) {
  Checker& c = checker;
  const int u = c.running->current;
  const uintptr_t to = reinterpret_cast<uintptr_t>(dst), from = reinterpret_cast<uintptr_t>(src);
  if (!in_shared_memory(to)) hazard(to, "cp.async destination outside shared memory");
  check_alignment(to, size_t(bytes), bytes == 16 ? "cp.async destination (16 bytes)" : "cp.async destination");
  if (in_shared_memory(from)) hazard(from, "cp.async source in shared memory (it must be global memory)");
  check_alignment(from, size_t(bytes), "cp.async source");
  Shadow* s = shadow_of(to, size_t(bytes), "cp.async writes");
  for (int i = 0; i < bytes; ++i) {
    check_write_byte(s[i], to + i, u, "cp.async writes");
    s[i].async_writer = int16_t(u);
  }
}

// A copy retired by cp.async.wait_group: its write counts from now.
FLOWGEN_EMU_QUIET inline void cp_async_retired(void* dst, int bytes) {
  Checker& c = checker;
  if (!c.active) return;
  const int u = c.running->current;
  const uintptr_t to = reinterpret_cast<uintptr_t>(dst);
  Shadow* s = shadow_of(to, size_t(bytes), "cp.async writes");
  for (int i = 0; i < bytes; ++i) {
    s[i].async_writer = -1;
    write_byte(s[i], u);
  }
}

// A wgmma reads `bytes` at `p` through the async proxy, from its issue to the wait that retires it:
// their last write must be ordered before the issue, and fenced (fence.proxy.async) by its writer
// after writing and before the barrier that orders it.
FLOWGEN_EMU_QUIET inline void wgmma_operand_issue(const unsigned char* p, int bytes) {
  Checker& c = checker;
  const int u = c.running->current;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  Shadow* s = shadow_of(a, size_t(bytes), "wgmma reads");
  for (int i = 0; i < bytes; ++i) {
    check_in_flight(s[i], a + i, "wgmma reads");
    if (s[i].write_interval >= c.block_start) {
      if (!ordered(s[i].writer, s[i].write_interval, s[i].write_epoch, u))
        hazard(a + i, "read-after-write race: a wgmma the thread issues reads shared memory that %s wrote with no "
                      "barrier between", thread_name(s[i].writer).c_str());
      const ThreadState& w = c.states[s[i].writer];
      if (!(s[i].write_fences < (s[i].writer == u ? w.fences : w.fences_at_sync)))
        hazard(a + i, "missing fence.proxy.async: a wgmma the thread issues reads (through the async proxy) shared "
                      "memory that %s wrote through the generic proxy without a fence.proxy.async between its "
                      "write and the barrier that orders it before the wgmma", thread_name(s[i].writer).c_str());
    }
    ++s[i].async_reads;
  }
}

// ... and wgmma_wait_group retires it: the read counts from now, as the thread's.
FLOWGEN_EMU_QUIET inline void wgmma_operand_retired(const unsigned char* p, int bytes) {
  Checker& c = checker;
  if (!c.active) return;
  const int u = c.running->current;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  Shadow* s = shadow_of(a, size_t(bytes), "wgmma reads");
  for (int i = 0; i < bytes; ++i) {
    --s[i].async_reads;
    read_byte(s[i], a + i, u, "wgmma reads", true);
  }
}

FLOWGEN_EMU_QUIET inline void proxy_fence() { ++checker.states[checker.running->current].fences; }

// Every wgmma.mma_async of a warpgroup must pass the same operands in all 128 threads.
FLOWGEN_EMU_QUIET inline void wgmma_signature(const WgmmaSignature& mine) {
  Checker& c = checker;
  const int u = c.running->current;
  std::vector<WgmmaSignature>& issued = c.signatures[u / 128];
  const uint32_t index = c.states[u].wgmma_issued++;
  if (index == issued.size()) {
    issued.push_back(mine);
    return;
  }
  const WgmmaSignature& first = issued[index];
  if (first.a_desc != mine.a_desc || first.b_desc != mine.b_desc || first.n != mine.n || first.k != mine.k ||
      first.scale_d != mine.scale_d || first.trans_a != mine.trans_a || first.trans_b != mine.trans_b)
    hazard(0, "wgmma operands differ within the warpgroup: the thread's wgmma #%u passes A descriptor %#llx, B "
              "descriptor %#llx, m64n%dk%d, scale-d %d, transposes %d/%d; %s passed %#llx, %#llx, m64n%dk%d, "
              "scale-d %d, transposes %d/%d", index, (unsigned long long)mine.a_desc,
           (unsigned long long)mine.b_desc, mine.n, mine.k, mine.scale_d, mine.trans_a, mine.trans_b,
           thread_name(first.thread).c_str(), (unsigned long long)first.a_desc, (unsigned long long)first.b_desc,
           first.n, first.k, first.scale_d, first.trans_a, first.trans_b);
}

// The accumulator bytes of the running thread's wgmma in flight, as a bounding box.
FLOWGEN_EMU_QUIET inline void track_accumulators(Block& b) {
  ThreadState& me = checker.states[b.current];
  me.accumulators_begin = me.accumulators_end = 0;
  const Block::WgmmaQueue& queue = b.wgmma[b.current];
  for (size_t g = 0; g <= queue.groups.size(); ++g) {
    const std::vector<Block::WarpgroupMma>& ops = g < queue.groups.size() ? queue.groups[g] : queue.open;
    for (const Block::WarpgroupMma& op : ops) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(op.d), end = begin + size_t(op.n / 2) * sizeof(float);
      if (me.accumulators_end == 0) me.accumulators_begin = begin, me.accumulators_end = end;
      me.accumulators_begin = std::min(me.accumulators_begin, begin);
      me.accumulators_end = std::max(me.accumulators_end, end);
    }
  }
}

// Whether [a, a + n) overlaps the accumulators of one of the running thread's wgmma in flight.
FLOWGEN_EMU_QUIET inline bool accumulators_in_flight(uintptr_t a, size_t n) {
  const Block& b = *checker.running;
  const Block::WgmmaQueue& queue = b.wgmma[b.current];
  for (size_t g = 0; g <= queue.groups.size(); ++g) {
    const std::vector<Block::WarpgroupMma>& ops = g < queue.groups.size() ? queue.groups[g] : queue.open;
    for (const Block::WarpgroupMma& op : ops) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(op.d), end = begin + size_t(op.n / 2) * sizeof(float);
      if (a < end && a + n > begin) return true;
    }
  }
  return false;
}

}  // namespace check
}  // namespace flowgen_emu

// ---------------------------------------------------------------------------------------
// The ThreadSanitizer entry points g++ calls (-fsanitize=thread, without libtsan). They run
// uninstrumented; atomics do what the builtins do and count as atomic accesses (checked for
// bounds, not for races).
#define FLOWGEN_EMU_CHECK_ENTRY extern "C" __attribute__((weak, visibility("hidden"), no_sanitize_thread, used))

FLOWGEN_EMU_CHECK_ENTRY void __tsan_init() {}
FLOWGEN_EMU_CHECK_ENTRY void __tsan_func_entry(void*) {}
FLOWGEN_EMU_CHECK_ENTRY void __tsan_func_exit() {}
FLOWGEN_EMU_CHECK_ENTRY void __tsan_vptr_update(void**, void*) {}
FLOWGEN_EMU_CHECK_ENTRY void __tsan_vptr_read(void**) {}
FLOWGEN_EMU_CHECK_ENTRY void __tsan_read_range(void* p, unsigned long n) {
  flowgen_emu::check::checked_access(p, n, flowgen_emu::check::Access::kRead, false);
}
FLOWGEN_EMU_CHECK_ENTRY void __tsan_write_range(void* p, unsigned long n) {
  flowgen_emu::check::checked_access(p, n, flowgen_emu::check::Access::kWrite, false);
}

#define FLOWGEN_EMU_CHECK_ACCESSES(N)                                                                          \
  FLOWGEN_EMU_CHECK_ENTRY void __tsan_read##N(void* p) {                                                      \
    flowgen_emu::check::checked_access(p, N, flowgen_emu::check::Access::kRead, true);                              \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY void __tsan_write##N(void* p) {                                                     \
    flowgen_emu::check::checked_access(p, N, flowgen_emu::check::Access::kWrite, true);                             \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY void __tsan_unaligned_read##N(void* p) {                                            \
    flowgen_emu::check::checked_access(p, N, flowgen_emu::check::Access::kRead, false);                             \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY void __tsan_unaligned_write##N(void* p) {                                           \
    flowgen_emu::check::checked_access(p, N, flowgen_emu::check::Access::kWrite, false);                            \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY void __tsan_volatile_read##N(void* p) {                                             \
    flowgen_emu::check::checked_access(p, N, flowgen_emu::check::Access::kRead, true);                              \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY void __tsan_volatile_write##N(void* p) {                                            \
    flowgen_emu::check::checked_access(p, N, flowgen_emu::check::Access::kWrite, true);                             \
  }
FLOWGEN_EMU_CHECK_ACCESSES(1)
FLOWGEN_EMU_CHECK_ACCESSES(2)
FLOWGEN_EMU_CHECK_ACCESSES(4)
FLOWGEN_EMU_CHECK_ACCESSES(8)
FLOWGEN_EMU_CHECK_ACCESSES(16)
#undef FLOWGEN_EMU_CHECK_ACCESSES

#define FLOWGEN_EMU_CHECK_ATOMICS(N, T)                                                                         \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_load(const volatile T* a, int) {                                \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                               \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY void __tsan_atomic##N##_store(volatile T* a, T v, int) {                             \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                                  \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                             \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                        \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) {                            \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) {                            \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) {                            \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) {                             \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                                          \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) {                            \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) {                           \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                                        \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* expected, T v, int, \
                                                                           int) {                              \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_compare_exchange_n(a, expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);             \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* expected, T v, int,   \
                                                                         int) {                                \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    return __atomic_compare_exchange_n(a, expected, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);              \
  }                                                                                                            \
  FLOWGEN_EMU_CHECK_ENTRY T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T expected, T v, int, int) { \
    flowgen_emu::check::checked_access(a, sizeof(T), flowgen_emu::check::Access::kAtomic, true);                    \
    __atomic_compare_exchange_n(a, &expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                   \
    return expected;                                                                                           \
  }
FLOWGEN_EMU_CHECK_ATOMICS(8, char)
FLOWGEN_EMU_CHECK_ATOMICS(16, short)
FLOWGEN_EMU_CHECK_ATOMICS(32, int)
FLOWGEN_EMU_CHECK_ATOMICS(64, long)
#undef FLOWGEN_EMU_CHECK_ATOMICS
FLOWGEN_EMU_CHECK_ENTRY void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
FLOWGEN_EMU_CHECK_ENTRY void __tsan_atomic_signal_fence(int) {}
#undef FLOWGEN_EMU_CHECK_ENTRY

// The collector's interface (runtime/cpu_compiler.py: CpuModule).
extern "C" __attribute__((weak, visibility("default"))) void flowgen_emu_check_collect(int on) {
  flowgen_emu::check::checker.collect = on != 0;
}
// The report of the last launch that failed, "" if none; flowgen_emu_check_clear forgets it.
extern "C" __attribute__((weak, visibility("default"))) const char* flowgen_emu_check_report() {
  return flowgen_emu::check::checker.report.c_str();
}
extern "C" __attribute__((weak, visibility("default"))) void flowgen_emu_check_clear() {
  flowgen_emu::check::checker.report.clear();
  flowgen_emu::check::checker.failed = false;
}
