# dsk - build, test, run.  `make run` trains the example model; `make test` runs every test.
# CUDA=1 builds the CUDA paths (needs nvcc; default when nvcc is on PATH), CUDA=0 forces CPU.
# A CUDA build still runs on a machine without a GPU: it detects that and uses the CPU.

CC      ?= gcc
CXX     ?= g++
NVCC    ?= nvcc
BUILD   ?= build
CUDA_HOME ?= /usr/local/cuda
CUDA    ?= $(if $(shell command -v $(NVCC) 2>/dev/null),1,0)
ARCH    ?= -march=native
OPT     ?= -O2
SAN     ?=
GENCODE ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90

WARN     = -Wall -Wextra -Werror
C_BASE   = -std=c11 $(OPT) $(ARCH) -g -fopenmp $(WARN) -I. $(SAN)
CFLAGS  += $(C_BASE)
CXXFLAGS+= -std=c++17 $(OPT) $(ARCH) -g -fopenmp $(WARN) -I. $(SAN)
LDLIBS  += -lm -lpthread
NVFLAGS ?= -O2 -std=c++17 $(GENCODE) -I. -Xcompiler -Wall,-Wextra,-Werror,-fPIC

HEADERS  = $(wildcard dsk_*.h) kernels/dsk_kernels.h $(wildcard kernels/*.cuh)
KSRC     = $(wildcard kernels/*.cu)
KOBJ     = $(patsubst kernels/%.cu,$(BUILD)/kernels/%.o,$(KSRC))
KLIB     = $(BUILD)/libdsk_kernels.a

ifeq ($(CUDA),1)
CFLAGS  += -DDSK_CUDA -I$(CUDA_HOME)/include
CXXFLAGS+= -DDSK_CUDA -I$(CUDA_HOME)/include
LDLIBS  := $(KLIB) -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lnccl -lcudart -lstdc++ $(LDLIBS)
DEPS     = $(HEADERS) $(KLIB)
else
DEPS     = $(HEADERS)
endif

TESTS     = $(patsubst tests/%.c,$(BUILD)/tests/%,$(wildcard tests/test_*.c))
GPU_TESTS = $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
EXAMPLES  = $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))
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
EMU_CXX    = -std=c++17 $(OPT) $(ARCH) -g $(WARN) -ffp-contract=off -I. $(EMU_INC) $(SAN)
EMU_CFLAGS = $(C_BASE) -DDSK_CUDA $(EMU_INC)
EMU_LIBS   = $(EMU_KLIB) $(EMU_LIB) -lstdc++ -lm -lpthread -lrt
EMU_TESTS  = $(patsubst tests/cuda_emu/%.cpp,$(EMU)/tests/%,$(wildcard tests/cuda_emu/test_*.cpp)) \
             $(patsubst tests/gpu/%.c,$(EMU)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
# The trainer on the emulated GPU, for the scripts that test its CUDA path (tests/test_train_graph.sh).
EMU_EXAMPLES = $(EMU)/examples/train_moe

.PHONY: all tests examples bench run test test-gpu sanitize fuzz clean
all: tests examples

tests: $(TESTS) $(GPU_TESTS) $(if $(filter 1,$(EMULATE)),$(EMU_TESTS) $(EMU_EXAMPLES))
examples: $(EXAMPLES)
bench: $(BENCHES)

$(BUILD)/kernels/%.o: kernels/%.cu $(HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

$(KLIB): $(KOBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(EMU)/obj/%.o: tests/cuda_emu/%.cpp $(EMU_HDR)
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXX) -c $< -o $@

$(EMU_LIB): $(EMU_OBJ)
	rm -f $@ && ar rcs $@ $^

$(EMU)/kernels/%.o: kernels/%.cu $(HEADERS) $(EMU_HDR)
	@mkdir -p $(dir $@)
	$(CXX) -x c++ $(EMU_CXX) -DDSK_CUDA -DDSK_CUDA_EMU -c $< -o $@

$(EMU_KLIB): $(patsubst kernels/%.cu,$(EMU)/kernels/%.o,$(KSRC))
	rm -f $@ && ar rcs $@ $^

$(EMU)/tests/gpu/%: tests/gpu/%.c tests/dsk_test.h $(wildcard tests/gpu/*.h) $(HEADERS) $(EMU_KLIB) $(EMU_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -o $@ $< $(EMU_LIBS)

$(EMU)/examples/%: examples/%.c $(wildcard examples/*.h) $(HEADERS) $(EMU_KLIB) $(EMU_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -o $@ $< $(EMU_LIBS)

# A benchmark on the emulated GPU (on demand, e.g. make build/emu/bench/bench_zero): shows every
# line of its CUDA path prints; the emulator's timings mean nothing.
$(EMU)/bench/%: bench/%.c bench/bench_util.h $(HEADERS) $(EMU_KLIB) $(EMU_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -o $@ $< $(EMU_LIBS)

$(EMU)/tests/%: tests/cuda_emu/%.cpp tests/dsk_test.h $(EMU_HDR) $(EMU_LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXX) -o $@ $< $(EMU_LIB) -lpthread -lrt

$(BUILD)/tests/%: tests/%.c tests/dsk_test.h $(wildcard tests/gpu/*.h) $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

# test_mla tests the example model (examples/train_model.h, train_mla.h).
$(BUILD)/tests/test_mla: $(wildcard examples/*.h)
# test_hf tests the Hugging Face import and export of the example model (examples/train_hf.h).
$(BUILD)/tests/test_hf: $(wildcard examples/*.h)

$(BUILD)/examples/%: examples/%.c $(wildcard examples/*.h) $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

# Benchmarks link their peers (OpenBLAS, Open MPI) where they need them; see bench/*.c.
BENCH_LIBS_bench_gemm = -lopenblas
$(BUILD)/bench/%: bench/%.c bench/bench_util.h $(DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(BENCH_LIBS_$*) $(LDLIBS)

# comm_bench's peer (bench only, never part of `make test`): Open MPI's MPI_Allreduce, built
# with mpicc from libopenmpi-dev; comm_bench --mpi runs it under mpirun from its own directory.
MPICC ?= mpicc
$(BUILD)/bench/mpi_allreduce: bench/mpi_allreduce.c bench/bench_util.h
	@mkdir -p $(dir $@)
	$(MPICC) -O2 -o $@ $<

run: $(BUILD)/examples/train_moe
	$(BUILD)/examples/train_moe --preset tiny $(ARGS)

test: tests examples
	@BUILD=$(BUILD) bash scripts/run_tests.sh

test-gpu: $(GPU_TESTS)
	@BUILD=$(BUILD) bash scripts/run_tests.sh gpu

# ASan + UBSan on the CPU build and on the emulated GPU path (CUDA's runtime does not run under ASan).
sanitize:
	$(MAKE) BUILD=build-san CUDA=0 OPT=-O1 SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" test

fuzz:
	@bash scripts/fuzz.sh

clean:
	rm -rf build build-san build-fuzz
