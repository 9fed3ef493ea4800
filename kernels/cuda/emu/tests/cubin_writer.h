// A minimal cubin for the emulator's tests: an ELF64 file with e_machine EM_CUDA (190), the
// architecture in e_flags as NVRTC writes it (ABI version 7: low byte, sm_80 … sm_90; ABI
// version 8: bits 8–15, sm_100 on), one `.text.<name>` section and global FUNC symbol per
// entry point, optionally `.nv.info.<name>` with one EIATTR_KPARAM_INFO record per parameter
// and `.nv.shared.<name>` with the static shared memory size. This is the subset of the format
// the emulator reads (driver.cpp, parse_cubin); the engine's tests load real NVRTC cubins.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

struct TestKernel {
    std::string name;
    bool with_params = false;  // write `.nv.info.<name>` with these parameter sizes
    std::vector<unsigned> params;
    unsigned shared = 0;  // static shared bytes (+1 KiB reserved from sm_90 on, as NVRTC)
};

inline std::vector<unsigned char> make_cubin(int arch, const std::vector<TestKernel>& ks) {
    struct Sec {
        std::string name;
        uint32_t type;
        std::vector<unsigned char> data;
        uint64_t nobits_size = 0;
        uint32_t link = 0, info = 0;
        uint64_t entsize = 0;
    };
    std::vector<Sec> secs;
    secs.push_back({"", 0, {}});
    secs.push_back({".shstrtab", 3, {}});
    secs.push_back({".strtab", 3, {}});
    secs.push_back({".symtab", 2, {}});
    auto put = [](std::vector<unsigned char>& v, const void* p, size_t n) {
        const unsigned char* b = (const unsigned char*)p;
        v.insert(v.end(), b, b + n);
    };
    std::vector<unsigned char> strtab(1, 0), symtab(24, 0);
    bool reserved = arch >= 90;
    if (reserved) secs.push_back({".nv.shared.reserved.0", 8, {}});
    for (const TestKernel& k : ks) {
        uint32_t text_idx = (uint32_t)secs.size();
        secs.push_back({".text." + k.name, 1, std::vector<unsigned char>(16, 0)});
        uint32_t name_off = (uint32_t)strtab.size();
        put(strtab, k.name.c_str(), k.name.size() + 1);
        uint32_t st_name = name_off;
        uint8_t info = (1 << 4) | 2, other = 0;
        uint16_t shndx = (uint16_t)text_idx;
        uint64_t value = 0, size = 16;
        put(symtab, &st_name, 4);
        put(symtab, &info, 1);
        put(symtab, &other, 1);
        put(symtab, &shndx, 2);
        put(symtab, &value, 8);
        put(symtab, &size, 8);
        if (k.with_params) {
            Sec s{".nv.info." + k.name, 0x70000000, {}};
            uint32_t off = 0;
            for (size_t i = 0; i < k.params.size(); i++) {
                unsigned sz = k.params[i];
                off = (off + sz - 1) / sz * sz;
                uint8_t hdr[4] = {4, 0x17, 12, 0};
                uint32_t index = 0, word = 0x1f000u | (sz << 18);
                uint16_t ordinal = (uint16_t)i, offset = (uint16_t)off;
                put(s.data, hdr, 4);
                put(s.data, &index, 4);
                put(s.data, &ordinal, 2);
                put(s.data, &offset, 2);
                put(s.data, &word, 4);
                off += sz;
            }
            secs.push_back(s);
        }
        if (k.shared) {
            Sec s{".nv.shared." + k.name, 8, {}};
            s.nobits_size = k.shared + (reserved ? 1024 : 0);
            secs.push_back(s);
        }
    }
    secs[2].data = strtab;
    secs[3].data = symtab;
    secs[3].link = 2;
    secs[3].entsize = 24;
    std::vector<unsigned char> shstr(1, 0);
    std::vector<uint32_t> name_offs;
    for (auto& s : secs) {
        name_offs.push_back(s.name.empty() ? 0 : (uint32_t)shstr.size());
        if (!s.name.empty()) put(shstr, s.name.c_str(), s.name.size() + 1);
    }
    secs[1].data = shstr;
    std::vector<unsigned char> out(64, 0);
    std::vector<uint64_t> offs;
    for (auto& s : secs) {
        while (out.size() % 8) out.push_back(0);
        offs.push_back(out.size());
        put(out, s.data.data(), s.data.size());
    }
    while (out.size() % 8) out.push_back(0);
    uint64_t shoff = out.size();
    for (size_t i = 0; i < secs.size(); i++) {
        const Sec& s = secs[i];
        unsigned char h[64] = {0};
        uint64_t size = s.type == 8 ? s.nobits_size : s.data.size();
        memcpy(h, &name_offs[i], 4);
        memcpy(h + 4, &s.type, 4);
        memcpy(h + 24, &offs[i], 8);
        memcpy(h + 32, &size, 8);
        memcpy(h + 40, &s.link, 4);
        memcpy(h + 44, &s.info, 4);
        memcpy(h + 56, &s.entsize, 8);
        put(out, h, 64);
    }
    unsigned char* e = out.data();
    memcpy(e, "\x7f" "ELF", 4);
    e[4] = 2;  // 64-bit
    e[5] = 1;  // little-endian
    e[6] = 1;
    e[7] = 0x41;
    e[8] = arch >= 100 ? 8 : 7;
    uint16_t type = 2, machine = 190, ehsize = 64, shentsize = 64, shnum = (uint16_t)secs.size(),
             shstrndx = 1;
    uint32_t version = 1, flags = arch >= 100 ? ((uint32_t)arch << 8) | 0x6000002u
                                               : ((uint32_t)arch << 16) | 0x500u | (uint32_t)arch;
    memcpy(e + 16, &type, 2);
    memcpy(e + 18, &machine, 2);
    memcpy(e + 20, &version, 4);
    memcpy(e + 0x28, &shoff, 8);
    memcpy(e + 48, &flags, 4);
    memcpy(e + 52, &ehsize, 2);
    memcpy(e + 0x3a, &shentsize, 2);
    memcpy(e + 0x3c, &shnum, 2);
    memcpy(e + 0x3e, &shstrndx, 2);
    return out;
}
