// SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0)
/* What BCC compiles first for --bpf-loader=bcc: only the maps (bpf/include/pyproxy/bcc.h, PYPROXY_BCC_TABLES). A
 * file rather than text, so that its includes are looked up from here and the include path, never from the working
 * directory, which BCC searches first for a text's includes. */
#include "pyproxy/maps.h"
