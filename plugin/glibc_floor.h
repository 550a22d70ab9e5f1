/*
 * glibc_floor.h -- make the plugin load with glibc >= 2.17 although it is
 * built against a newer one (docs/plugin.md, "Which glibc").
 *
 * The plugin is dlopened inside the user's training image, whose glibc may
 * be older than the build host's (Ubuntu 20.04: 2.31; manylinux2014: 2.17).
 * A shared object asks for each versioned symbol at the version it was
 * linked against, and the loader refuses the library when a version is
 * missing.  glibc 2.34 moved libdl and libpthread into libc.so.6 under a new
 * version GLIBC_2.34, and 2.32/2.14 gave pthread_sigmask and memcpy new
 * versions; the old versions are still in libc.so.6 as compatibility symbols.
 * The .symver directives below bind this file's references to those old
 * versions, which every glibc since the floor defines:
 *  - x86-64: the base version GLIBC_2.2.5 (pthread_setname_np: GLIBC_2.12);
 *  - aarch64: its base version GLIBC_2.17 (the first glibc for aarch64).
 * Before 2.34 the dl* and pthread_* symbols live in libdl.so.2 and
 * libpthread.so.0: the build links them explicitly with --no-as-needed
 * (exporter/sources/plugin/build.py), so they are loaded there; the loader
 * matches a symbol by name and version, not by the file that provided it.
 * tests/test_plugin_platforms.py reads the highest GLIBC_ version the built
 * library needs (objdump -T) and fails above 2.17.  A new libc call that
 * needs a version above 2.17 is pinned here, or avoided.
 * Include before any other header; it declares nothing.
 */
#ifndef NCCL_EXPORTER_GLIBC_FLOOR_H
#define NCCL_EXPORTER_GLIBC_FLOOR_H

#if defined(__x86_64__)
#define NXP_GLIBC_BASE "GLIBC_2.2.5"
#define NXP_GLIBC_SETNAME "GLIBC_2.12"
#elif defined(__aarch64__)
#define NXP_GLIBC_BASE "GLIBC_2.17"
#define NXP_GLIBC_SETNAME "GLIBC_2.17"
#endif

#ifdef NXP_GLIBC_BASE
#define NXP_PIN(sym, ver) __asm__(".symver " #sym "," #sym "@" ver)
NXP_PIN(dlopen, NXP_GLIBC_BASE);
NXP_PIN(dlsym, NXP_GLIBC_BASE);
NXP_PIN(dladdr, NXP_GLIBC_BASE);
NXP_PIN(dlclose, NXP_GLIBC_BASE);
NXP_PIN(dlerror, NXP_GLIBC_BASE);
NXP_PIN(pthread_create, NXP_GLIBC_BASE);
NXP_PIN(pthread_join, NXP_GLIBC_BASE);
NXP_PIN(pthread_sigmask, NXP_GLIBC_BASE);
NXP_PIN(pthread_setname_np, NXP_GLIBC_SETNAME);
/* GLIBC_2.14's memcpy may not overlap; ours never do, and the old one is memmove */
NXP_PIN(memcpy, NXP_GLIBC_BASE);
#undef NXP_PIN
#endif

#endif
