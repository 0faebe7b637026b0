"""tools/scan_sass.py: async copies that read uniform registers their kernel never writes (the
fp8 miscompile) are found, copies whose registers are written are not; warp-specialized kernels
whose softmax waits for PV are found, those with the softmax between the waits are not."""
from __future__ import annotations

import tool_module

scan_sass = tool_module.load("scan_sass")

_GOOD = """
		Function : good_kernel
        /*0910*/                   UMOV UR10, 0xf0 ;                         /* 0x000000f0000a7882 */
        /*0960*/                   UMOV UR11, 0x120 ;                        /* 0x00000120000b7882 */
        /*0a00*/                   ULDC.64 UR4, c[0x0][0x208] ;              /* 0x0000820000047ab9 */
        /*0dc0*/                   LDGSTS.E.BYPASS.128 [R181+0x1000], desc[UR10][R4.64], !P3 ;  /* 0x0 */
        /*0dd0*/                   LDGSTS.E.BYPASS.128 [R181+UR5], desc[UR10][R4.64], !P3 ;     /* 0x0 */
"""
_BAD = """
		Function : bad_kernel
        /*0910*/                   UMOV UR10, 0xf0 ;                         /* 0x000000f0000a7882 */
        /*0dc0*/              @!PT LDS RZ, [RZ] ;                            /* 0x0 */
        /*0dd0*/                   LDGSTS.E.BYPASS.128 [R181+UR0+0x1000], desc[UR1][R4.64], !P3 ;  /* 0x0 */
"""


def test_copies_reading_unwritten_uniform_registers_are_found():
    assert scan_sass.unwritten_uniform_reads(_GOOD) == []
    (hit,) = scan_sass.unwritten_uniform_reads(_GOOD + _BAD)
    assert hit[0] == "bad_kernel" and "desc[UR1]" in hit[1]


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert scan_sass.main([str(tmp_path / "missing"), "--cuobjdump", "/bin/true"]) == 2
    assert scan_sass.main([str(tmp_path), "--cuobjdump", "/bin/true"]) == 2   # no CUBIN in it
    assert "scan_sass:" in capsys.readouterr().err


def _ws(name, between):
    return (f"\n\t\tFunction : {name}\n"
            "        /*3460*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;           /* 0x0 */\n"
            + between +
            "        /*4500*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;           /* 0x0 */\n")


def test_softmax_after_pv_is_found_in_warp_specialized_kernels():
    """kv64: 32 exponentials per thread and block; 16 between the waits pass, 15 (part of the
    softmax hoisted under PV's wait) or none do not."""
    mufu = "        /*3ee0*/                   MUFU.EX2 R88, R88 ;                      /* 0x0 */\n"
    fmnmx = "        /*3b80*/                   FMNMX R17, R88, R89, !PT ;               /* 0x0 */\n"
    under = _ws("rtattn_prefill_causal_bfloat16_d128_ws_q128_kv64_w8_s4_b1", fmnmx + 16 * mufu)
    after = _ws("rtattn_prefill_alibi_bfloat16_d128_ws_q128_kv64_w8_s4_b1", fmnmx) + 32 * mufu
    partly = _ws("rtattn_prefill_plain_bfloat16_d128_ws_q128_kv64_w8_s4_b1", 15 * mufu) + 17 * mufu
    narrow = _ws("rtattn_prefill_causal_bfloat16_d256_ws_q128_kv32_w8_s2_b1", 8 * mufu)   # kv32: 8 pass
    other = _ws("rtattn_prefill_causal_bfloat16_d128_wg_q128_kv32_w8_s3_pp_b2", fmnmx)   # not ws: not checked
    assert scan_sass.softmax_after_pv(under + narrow + other) == []
    assert scan_sass.softmax_after_pv(under + after + partly) == [
        "rtattn_prefill_alibi_bfloat16_d128_ws_q128_kv64_w8_s4_b1", "rtattn_prefill_plain_bfloat16_d128_ws_q128_kv64_w8_s4_b1"]
