# dsk - build, test, run.  `make run` trains the example model; `make test` runs every test.
# CUDA=1 builds the CUDA paths (needs nvcc; default when nvcc is on PATH), CUDA=0 forces CPU.
# A CUDA build still runs on a machine without a GPU: it detects that and uses the CPU.

CC      ?= gcc
CXX     ?= g++
NVCC    ?= nvcc
BUILD   ?= build
CUDA_HOME ?= /usr/local/cuda
# NCCL_HOME: where NCCL is when it is not in CUDA_HOME (include/nccl.h, lib/libnccl.so), e.g. pip's
# nvidia-nccl wheel; scripts/device_check.sh finds it.
NCCL_HOME ?=
CUDA    ?= $(if $(shell command -v $(NVCC) 2>/dev/null),1,0)
ARCH    ?= -march=native
OPT     ?= -O2
# DEBUG: debug information; .ci/run builds with DEBUG= (nothing there reads it; a fifth faster).
DEBUG   ?= -g
SAN     ?=
GENCODE ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90

WARN    ?= -Wall -Wextra -Werror
C_BASE   = -std=c11 $(OPT) $(ARCH) $(DEBUG) -fopenmp $(WARN) -I. $(SAN)
CFLAGS  += $(C_BASE)
CXXFLAGS+= -std=c++17 $(OPT) $(ARCH) $(DEBUG) -fopenmp $(WARN) -I. $(SAN)
LDLIBS  += -lm -lpthread
NVFLAGS ?= -O2 -std=c++17 $(GENCODE) -I. -Xcompiler -Wall,-Wextra,-Werror,-fPIC

HEADERS  = $(wildcard dsk_*.h) $(wildcard kernels/*.cuh)
KSRC     = $(wildcard kernels/*.cu)
KOBJ     = $(patsubst kernels/%.cu,$(BUILD)/kernels/%.o,$(KSRC))
KLIB     = $(BUILD)/libdsk_kernels.a

ifeq ($(CUDA),1)
CFLAGS  += -DDSK_CUDA -I$(CUDA_HOME)/include
CXXFLAGS+= -DDSK_CUDA -I$(CUDA_HOME)/include
# No -lcublas: kernels/tensor.cu dlopens it when the first CUDA context is made, so that CPU-only
# runs of a CUDA build do not pay for loading it. -ldl: dlopen before glibc 2.34.
LDLIBS  := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lnccl -lcudart -ldl -lstdc++ $(LDLIBS)
CUBLAS_LIB = -lcublas
KLINK    = $(KLIB)
ifneq ($(NCCL_HOME),)
CFLAGS  += -I$(NCCL_HOME)/include
CXXFLAGS+= -I$(NCCL_HOME)/include
LDLIBS  := -L$(NCCL_HOME)/lib -Wl,-rpath,$(NCCL_HOME)/lib $(LDLIBS)
endif
else
CUBLAS_LIB =
KLINK    =
endif

# The library, compiled once per configuration (BUILD): one object per module, each its header
# with its IMPLEMENTATION macro, in $(BUILD)/libdsk.a. Tests and examples include the headers
# without the macro and link it, as an stb-style user's program does. The tests that call a
# module's private (static) functions or replace its allocator compile the implementation
# themselves (SELF_IMPL; DESIGN.md, Tests). The kernels and the library call each other: a group.
MODULES  = tensor comm moe amp ckpt par zero plan
LIB      = $(BUILD)/libdsk.a
LIB_LINK = -Wl,--start-group $(LIB) $(KLINK) -Wl,--end-group
DEPS     = $(HEADERS) $(LIB) $(KLINK) $(CONFIG)
SELF_IMPL = $(BUILD)/tests/test_tensor $(BUILD)/tests/test_oom

# tests/trainer/: the tests of the example trainer's own code (its model), not of a library module.
TESTS     = $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c tests/trainer/test_*.c))
GPU_TESTS = $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
EXAMPLES  = $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))
# The trainer's headers: the example's model and helpers, and examples/train/ (train_moe.c's parts).
EXAMPLE_HDR = $(wildcard examples/*.h examples/train/*.h)
BENCH_SRC = $(wildcard bench/*.c)
BENCHES   = $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))

# The CPU emulation of CUDA, cuBLAS and NCCL (tests/cuda_emu, a test double that never links
# into the library or the examples): the kernels compiled as host C++ and every GPU test
# linked against it, in $(BUILD)/emu. Needs no nvcc; `make test` runs these (EMULATE=0: not built).
EMULATE   ?= 1
EMU        = $(BUILD)/emu
EMU_INC    = -Itests/cuda_emu/include
EMU_HDR    = $(wildcard tests/cuda_emu/*.h tests/cuda_emu/include/*.h tests/cuda_emu/include/cub/*.cuh)
EMU_OBJ    = $(patsubst tests/cuda_emu/%.cpp,$(EMU)/obj/%.o,$(filter-out tests/cuda_emu/test_%,$(wildcard tests/cuda_emu/*.cpp)))
EMU_LIB    = $(EMU)/libcuda_emu.a
EMU_KLIB   = $(EMU)/libdsk_kernels.a
EMU_CXX    = -std=c++17 $(OPT) $(ARCH) $(DEBUG) $(WARN) -ffp-contract=off -I. $(EMU_INC) $(SAN)
EMU_CFLAGS = $(C_BASE) -DDSK_CUDA $(EMU_INC)
EMU_DSK    = $(EMU)/libdsk.a
EMU_LIBS   = -Wl,--start-group $(EMU_DSK) $(EMU_KLIB) $(EMU_LIB) -Wl,--end-group -lstdc++ -lm -lpthread -lrt
EMU_SELF_LIBS = $(EMU_KLIB) $(EMU_LIB) -lstdc++ -lm -lpthread -lrt
EMU_DEPS   = $(HEADERS) $(EMU_HDR) $(EMU_DSK) $(EMU_KLIB) $(EMU_LIB) $(CONFIG)
EMU_TESTS  = $(patsubst tests/cuda_emu/%.cpp,$(EMU)/tests/%,$(wildcard tests/cuda_emu/test_*.cpp)) \
             $(patsubst tests/gpu/%.c,$(EMU)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
# The trainer on the emulated GPU, for the scripts that test its CUDA path (tests/test_train_graph.sh),
# and the CUDA-graph example (tests/test_teach.sh).
EMU_EXAMPLES = $(EMU)/examples/train_moe $(EMU)/examples/cuda_graph_step

MPICC ?= mpicc
# Everything in BUILD records the flags it was built with ($(BUILD)/.flags): building with other
# flags in the same BUILD (CUDA=0 after CUDA=1, another CC) rebuilds everything instead of mixing.
CONFIG      = $(BUILD)/.flags
CONFIG_TEXT = $(CC) $(CXX) $(CUDA) $(CFLAGS) | $(CXXFLAGS) | $(NVFLAGS) | $(EMU_CXX) | $(LDLIBS)
ifeq ($(filter clean,$(MAKECMDGOALS)),)
ifneq ($(file < $(CONFIG)),$(CONFIG_TEXT))
$(shell mkdir -p $(BUILD))
$(file > $(CONFIG),$(CONFIG_TEXT))
endif
endif

.PHONY: all lib tests examples bench run test test-gpu lint sanitize tsan fuzz print-cuda clean
all: tests examples
lib: $(LIB)

# The GPU tests as nvcc's build links them only in a CUDA build: built with CUDA=0 every case would
# skip (the emulated builds in $(EMU) run them). NVCC_TESTS=0 leaves them out of a CUDA build too:
# .ci/run on a machine without a GPU, where they cannot run (the kernels still compile: the
# library's programs link them).
NVCC_TESTS ?= $(CUDA)
tests: $(TESTS) $(if $(filter 1,$(NVCC_TESTS)),$(GPU_TESTS)) $(if $(filter 1,$(EMULATE)),$(EMU_TESTS) $(EMU_EXAMPLES))
examples: $(EXAMPLES)
# Benchmarks whose peer is missing here are left out: bench_gemm without OpenBLAS (another
# BLAS's cblas.h lacks openblas_*), mpi_allreduce without Open MPI's mpi.h. Probed when asked.
# The libraries first: the recursive make must not build them beside this one (make -j tests bench).
bench: $(LIB) $(KLINK)
	@skip=""; \
	printf '#include <cblas.h>\nint main(void) { openblas_set_num_threads(1); return 0; }\n' | \
	    $(CC) -x c - -lopenblas -o /dev/null 2>/dev/null || skip="$$skip bench_gemm"; \
	printf '#include <mpi.h>\nint main(void) { return 0; }\n' | \
	    $(MPICC) -x c - -o /dev/null 2>/dev/null || skip="$$skip mpi_allreduce"; \
	targets=""; for b in $(BENCHES); do case " $$skip " in *" $${b##*/} "*) ;; *) targets="$$targets $$b";; esac; done; \
	[ -z "$$skip" ] || echo "bench: left out (peer library missing):$$skip"; \
	$(MAKE) --no-print-directory $$targets

$(BUILD)/kernels/%.o: kernels/%.cu $(HEADERS) $(CONFIG)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

$(KLIB): $(KOBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# One module of the library: its header with its IMPLEMENTATION macro, included (-include) by an
# empty file so that it is not the main file (clang flags unused static inline functions there).
# dsk_moe_amp_unscale exists where dsk_amp.h comes before dsk_moe.h: the library's has it.
LIB_PRE_moe = -include dsk_amp.h
$(BUILD)/lib/%.o: dsk_%.h $(HEADERS) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DDSK_$(shell echo $* | tr a-z A-Z)_IMPLEMENTATION $(LIB_PRE_$*) -include $< -c -x c /dev/null -o $@

$(LIB): $(patsubst %,$(BUILD)/lib/%.o,$(MODULES))
	rm -f $@ && ar rcs $@ $^

$(EMU)/lib/%.o: dsk_%.h $(HEADERS) $(EMU_HDR) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -DDSK_$(shell echo $* | tr a-z A-Z)_IMPLEMENTATION $(LIB_PRE_$*) -include $< -c -x c /dev/null -o $@

$(EMU_DSK): $(patsubst %,$(EMU)/lib/%.o,$(MODULES))
	rm -f $@ && ar rcs $@ $^

$(EMU)/obj/%.o: tests/cuda_emu/%.cpp $(EMU_HDR) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXX) -c $< -o $@

$(EMU_LIB): $(EMU_OBJ)
	rm -f $@ && ar rcs $@ $^

$(EMU)/kernels/%.o: kernels/%.cu $(HEADERS) $(EMU_HDR) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CXX) -x c++ $(EMU_CXX) -DDSK_CUDA -DDSK_CUDA_EMU -c $< -o $@

$(EMU_KLIB): $(patsubst kernels/%.cu,$(EMU)/kernels/%.o,$(KSRC))
	rm -f $@ && ar rcs $@ $^

$(EMU)/tests/gpu/%: tests/gpu/%.c tests/dsk_test.h $(wildcard tests/gpu/*.h) $(EMU_DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -o $@ $< $(EMU_LIBS)

$(EMU)/examples/%: examples/%.c $(EMU_DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -o $@ $< $(EMU_LIBS)

# A benchmark on the emulated GPU (on demand, e.g. make build/emu/bench/bench_zero): shows every
# line of its CUDA path prints; the emulator's timings mean nothing. Benchmarks compile the
# implementation themselves.
$(EMU)/bench/%: bench/%.c bench/bench_util.h $(EMU_DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -o $@ $< $(EMU_SELF_LIBS)

$(EMU)/tests/%: tests/cuda_emu/%.cpp tests/dsk_test.h $(EMU_HDR) $(EMU_LIB) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXX) -o $@ $< $(EMU_LIB) -lpthread -lrt

$(BUILD)/tests/%: tests/%.c tests/dsk_test.h tests/dsk_test_files.h $(wildcard tests/gpu/*.h) $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(LIB_LINK) $(LDLIBS)

# These define every implementation they use themselves (they test private functions or replace
# DSK_MALLOC). test_ckpt, test_safetensors, test_comm and gpu/test_moe_gpu define only their own
# module's: the modules below it come from libdsk.a, whose object of that module nothing pulls in.
$(SELF_IMPL): LIB_LINK = $(KLINK)

# The trainer includes its examples/train_*.h and train/*.h; the other examples are one file each.
$(BUILD)/examples/train_moe $(EMU)/examples/train_moe: $(EXAMPLE_HDR)
# trainer/test_model tests the example model (examples/train_model.h, train_mla.h), trainer/test_hf
# its Hugging Face import and export (examples/train_hf.h).
$(BUILD)/tests/trainer/test_model $(BUILD)/tests/trainer/test_hf: $(EXAMPLE_HDR)

# dsk_plan is the trainer's own sizing code run without memory: it compiles train_moe.c into itself.
$(BUILD)/examples/dsk_plan: examples/train_moe.c $(EXAMPLE_HDR)
$(BUILD)/examples/%: examples/%.c $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(LIB_LINK) $(LDLIBS)

# Benchmarks link their peers (OpenBLAS, Open MPI) where they need them; see bench/*.c. They
# compile the implementation themselves.
BENCH_LIBS_bench_gemm = -lopenblas
# bench_fp8 and bench_gpu_ops call cuBLAS themselves (their peer): linked, where the library dlopens it.
BENCH_LIBS_bench_fp8 = $(CUBLAS_LIB)
BENCH_LIBS_bench_gpu_ops = $(CUBLAS_LIB)
$(BUILD)/bench/%: bench/%.c bench/bench_util.h $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(BENCH_LIBS_$*) $(KLINK) $(LDLIBS)

# comm_bench's peer (bench only, never part of `make test`): Open MPI's MPI_Allreduce, built
# with mpicc from libopenmpi-dev; comm_bench --mpi runs it under mpirun from its own directory.
$(BUILD)/bench/mpi_allreduce: bench/mpi_allreduce.c bench/bench_util.h
	@mkdir -p $(dir $@)
	$(MPICC) -O2 -o $@ $<

# `make run` trains on a GPU with the CUDA build where one is usable (nvidia-smi lists one, or
# RUN_CUDA=1), else with the CPU build: a machine with nvcc but no GPU compiles no kernels
# (the CPU build of a CUDA=1 tree goes to $(BUILD)/cpu). The banner names the device.
HAVE_GPU = $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo 1)
RUN_CUDA ?= $(if $(and $(HAVE_GPU),$(filter 1,$(CUDA))),1,0)
RUN_BUILD = $(if $(filter 1,$(RUN_CUDA)),$(BUILD),$(if $(filter 1,$(CUDA)),$(BUILD)/cpu,$(BUILD)))
run:
	@$(MAKE) --no-print-directory CUDA=$(RUN_CUDA) BUILD=$(RUN_BUILD) $(RUN_BUILD)/examples/train_moe
	$(RUN_BUILD)/examples/train_moe --preset tiny $(ARGS)

test: tests examples
	@echo "# also: make sanitize (ASan + UBSan), make tsan (ThreadSanitizer on the programs that start threads)"
	@BUILD=$(BUILD) bash scripts/run_tests.sh

# DESIGN.md's rules as checks (scripts/lint.sh; DESIGN.md, Rules as checks): clang-format and 120
# columns on the lines changed since LINT_BASE, mutable state, CUDA calls, commit subjects, and
# DESIGN.md's count of the places to touch for an elementwise op.
# `make test` runs them too, as tests/test_lint.sh, with cases that plant a violation for each.
lint:
	@bash scripts/lint.sh

test-gpu: $(GPU_TESTS)
	@BUILD=$(BUILD) bash scripts/run_tests.sh gpu

# ASan + UBSan on the CPU build and on the emulated GPU path (CUDA's runtime does not run under ASan).
# allocator_may_return_null: an allocation larger than ASan serves returns NULL, as malloc does,
# so the tests of DSK_ERR_OOM see the library's answer rather than ASan's abort.
sanitize:
	ASAN_OPTIONS=allocator_may_return_null=1$${ASAN_OPTIONS:+:$$ASAN_OPTIONS} $(MAKE) BUILD=build-san CUDA=0 OPT=-O1 SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

# ThreadSanitizer on the programs that start threads (scripts/tsan.sh says which and why). clang:
# gcc rejects the shared-memory rings' __atomic_thread_fence under -fsanitize=thread (-Wtsan).
TSAN_BUILD ?= build-tsan
TSAN_CC    ?= clang
tsan:
	$(MAKE) BUILD=$(TSAN_BUILD) CC=$(TSAN_CC) CUDA=0 EMULATE=0 OPT=-O1 SAN="-fsanitize=thread -fno-omit-frame-pointer" \
	    $(TSAN_BUILD)/tests/test_ckpt $(TSAN_BUILD)/tests/test_comm $(TSAN_BUILD)/examples/train_moe \
	    $(TSAN_BUILD)/bench/bench_moe_ep
	@BUILD=$(TSAN_BUILD) bash scripts/tsan.sh

fuzz:
	@bash scripts/fuzz.sh

# 1 when this configuration builds the CUDA paths (.ci/run asks).
print-cuda:
	@echo $(CUDA)

clean:
	rm -rf build build-san build-tsan build-fuzz build-ci-*
