/* What one short OpenMP parallel region costs under the runtime that serves this process.
 *
 * Speculative decoding on CPU runs many short parallel regions per token (a draft model's
 * small matmuls, the verify step) with a little single-threaded work between them (Python
 * between kernels). Whether the team's threads still spin when the next region starts,
 * or sleep and must be woken, decides what each region costs: this times that alone.
 * scripts/bench_omp_regions.py compiles it (gcc -O2 -fopenmp: libgomp is linked) and swaps
 * the other runtimes in with LD_PRELOAD, as the launcher does (libiomp5 and LLVM's libomp
 * export the GOMP_* entry points gcc's code calls).
 *
 *   omp_regions [--size N] [--regions R] [--reps K] [--warmup W] [--gap-us G]
 *
 * Each of K repetitions times R regions (one `parallel for` over N doubles each), a serial
 * gap of G microseconds after each, after W untimed regions; it prints one JSON line: the
 * library that serves GOMP_parallel and omp_get_max_threads, the team's size, and the
 * median and min over the repetitions of the mean time per region, in microseconds.
 * Plain C, no dependency beyond the OpenMP runtime and the C library.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* libgomp's entry point for `#pragma omp parallel`; its address, taken as this program
 * binds it, is in whichever library the dynamic loader resolved it to. */
void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* The single-threaded work between two regions: the main thread busy, the team idle. */
static void serial_gap(double gap_us) {
    if (gap_us <= 0) return;
    double end = now_us() + gap_us;
    while (now_us() < end) {
    }
}

static void region(double *a, const double *b, long n) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++) a[i] = a[i] * 0.999 + b[i];
}

static int team_size(void) {
    int team = 0;
#pragma omp parallel
    {
#pragma omp single
        team = omp_get_num_threads();
    }
    return team;
}

/* The file of the library that defines the code at address (or "?"). */
static const char *library_of(void *address) {
    Dl_info info;
    if (dladdr(address, &info) == 0 || info.dli_fname == NULL) return "?";
    return info.dli_fname;
}

static void print_json_string(const char *text) {
    putchar('"');
    for (const unsigned char *c = (const unsigned char *)text; *c; c++) {
        if (*c == '"' || *c == '\\')
            printf("\\%c", *c);
        else if (*c < 0x20)
            printf("\\u%04x", *c);
        else
            putchar(*c);
    }
    putchar('"');
}

static int compare_doubles(const void *left, const void *right) {
    double l = *(const double *)left, r = *(const double *)right;
    return (l > r) - (l < r);
}

static int read_option(int argc, char **argv, int *i, const char *name, double *value) {
    if (strcmp(argv[*i], name) != 0) return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "omp_regions: %s needs a value\n", name);
        exit(2);
    }
    char *end;
    *value = strtod(argv[++*i], &end);
    if (*end != '\0' || *value < 0) {
        fprintf(stderr, "omp_regions: %s %s: not a number >= 0\n", name, argv[*i]);
        exit(2);
    }
    return 1;
}

int main(int argc, char **argv) {
    double size = 32768, regions = 1000, reps = 5, warmup = 200, gap_us = 20;
    for (int i = 1; i < argc; i++) {
        if (!(read_option(argc, argv, &i, "--size", &size) ||
              read_option(argc, argv, &i, "--regions", &regions) ||
              read_option(argc, argv, &i, "--reps", &reps) ||
              read_option(argc, argv, &i, "--warmup", &warmup) ||
              read_option(argc, argv, &i, "--gap-us", &gap_us))) {
            fprintf(stderr, "omp_regions: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    long n = (long)size, count = (long)regions, repetitions = (long)reps;
    if (n < 1 || count < 1 || repetitions < 1) {
        fprintf(stderr, "omp_regions: --size, --regions and --reps must be at least 1\n");
        return 2;
    }
    double *a = malloc(sizeof(double) * n), *b = malloc(sizeof(double) * n);
    double *per_region = malloc(sizeof(double) * repetitions);
    if (a == NULL || b == NULL || per_region == NULL) return 2;
    for (long i = 0; i < n; i++) a[i] = 0, b[i] = (double)(1 + i % 7);
    int team = team_size();
    for (long r = 0; r < (long)warmup; r++) {
        region(a, b, n);
        serial_gap(gap_us);
    }
    for (long k = 0; k < repetitions; k++) {
        double inside = 0;
        for (long r = 0; r < count; r++) {
            double start = now_us();
            region(a, b, n);
            inside += now_us() - start;
            serial_gap(gap_us);
        }
        per_region[k] = inside / (double)count;
    }
    double median_source[repetitions];
    memcpy(median_source, per_region, sizeof(double) * repetitions);
    qsort(median_source, repetitions, sizeof(double), compare_doubles);
    double median = repetitions % 2 ? median_source[repetitions / 2]
                                    : (median_source[repetitions / 2 - 1] +
                                       median_source[repetitions / 2]) / 2;
    printf("{\"runtime\": ");
    print_json_string(library_of((void *)&GOMP_parallel));
    printf(", \"omp_runtime\": ");
    print_json_string(library_of((void *)&omp_get_max_threads));
    printf(", \"threads\": %d, \"team\": %d, \"size\": %ld, \"regions\": %ld, \"reps\": %ld",
           omp_get_max_threads(), team, n, count, repetitions);
    printf(", \"warmup\": %ld, \"gap_us\": %g, \"median_us\": %.4f, \"min_us\": %.4f",
           (long)warmup, gap_us, median, median_source[0]);
    printf(", \"reps_us\": [");
    for (long k = 0; k < repetitions; k++) printf("%s%.4f", k ? ", " : "", per_region[k]);
    printf("], \"checksum\": %g}\n", a[n - 1]);
    free(a), free(b), free(per_region);
    return 0;
}
