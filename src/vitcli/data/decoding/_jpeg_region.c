/* vitcli.data.decoding._jpeg_region: decode only a box of a JPEG, at M/8 scale, with libjpeg(-turbo).
 *
 * A training crop is a fraction of its image (RandomResizedCrop draws 8-100% of the area), yet a whole-image
 * decoder runs the inverse DCT, upsampling and colour conversion on every pixel. libjpeg-turbo's API can
 * skip most of that work: jpeg_crop_scanline limits decoding to the iMCU columns that hold the box (16 px
 * wide for 4:2:0 at full scale), jpeg_skip_scanlines only entropy-decodes the iMCU rows above it (a
 * progressive file's scans are all read at jpeg_start_decompress anyway), and stopping after the box's last
 * row leaves the rows below unread. DCT scaling (scale_num/8) is libjpeg's own.
 *
 * The output equals a whole-image decode with the same settings (islow IDCT, fancy upsampling, the ones
 * torchvision's and PIL's decoders use), sliced (tests/unit/test_jpeg_region.py). For that, one column of
 * context is decoded on each side of the box and dropped: the fancy upsampler reads the chroma sample on each
 * side of a pixel and, at a cropped span's edge, repeats the edge sample instead (libjpeg.txt, "Partial
 * image decompression"). Rows need none: jpeg_skip_scanlines keeps the upsampler's context rows itself.
 *
 * Python sees one function, decode(data, out, top, left, height, width, eighths) -> bool (see its doc).
 * libjpeg reports errors through error_exit, which must not return: it longjmps back to decode_box, which
 * destroys the decompressor (freeing every pool) and reports the message. The GIL is released while libjpeg
 * runs, so decoding threads do not serialise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h> /* jpeglib.h needs FILE */
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

typedef struct {
    struct jpeg_error_mgr pub; /* first: libjpeg hands error_exit a pointer to it */
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} Failure;

typedef struct {
    JDIMENSION top, left, height, width; /* in output pixels, at the requested scale */
} Box;

enum { DECODED, UNSUPPORTED, OUTSIDE, FAILED };

/* The narrowest span decoded, in output pixels: a span whose chroma is one sample wide (2 px of 4:2:0) makes
 * libjpeg swap its fancy upsampler for plain replication, unlike the whole image's decode; 16 px keeps even
 * 4:1:1 chroma 4 samples wide. */
#define MIN_SPAN 16

static void fail(j_common_ptr cinfo)
{
    Failure *failure = (Failure *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, failure->message);
    longjmp(failure->jump, 1);
}

/* A warning is data libjpeg recovers from (extraneous bytes, a bad Huffman code): silent, as torchvision's
 * decoder lets it pass; but running out of data ("Premature end of JPEG file", after which jpeg_mem_src
 * feeds a fake EOI and grey pixels) is an error, as it is for torchvision ("Image is incomplete or
 * truncated") and PIL ("image file is truncated"). */
static void warn(j_common_ptr cinfo, int msg_level)
{
    if (msg_level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF)
        fail(cinfo);
}

/* Rows [box.top, box.top + box.height) of the scanlines (already cropped to start at column xoffset), their
 * columns [box.left, box.left + box.width) copied into out, (height, width, 3) RGB. */
static void read_rows(j_decompress_ptr cinfo, unsigned char *out, Box box, JDIMENSION xoffset)
{
    JSAMPARRAY row = (*cinfo->mem->alloc_sarray)((j_common_ptr)cinfo, JPOOL_IMAGE,
                                                 cinfo->output_width * 3, 1);
    size_t stride = (size_t)box.width * 3;

    jpeg_skip_scanlines(cinfo, box.top);
    for (JDIMENSION y = 0; y < box.height; y++) {
        jpeg_read_scanlines(cinfo, row, 1);
        memcpy(out + y * stride, row[0] + (size_t)(box.left - xoffset) * 3, stride);
    }
}

/* Decode `box` of the JPEG in data[0:size] at eighths/8 scale into out. Returns DECODED, UNSUPPORTED (a
 * colour space libjpeg cannot turn into RGB: CMYK, YCCK), OUTSIDE (the box leaves the scaled image) or
 * FAILED (failure->message says why). Touches no Python object: runs without the GIL. */
static int decode_box(const unsigned char *data, size_t size, unsigned char *out, Box box, int eighths,
                      Failure *failure)
{
    struct jpeg_decompress_struct cinfo;
    JDIMENSION x0, x1, xoffset, width;

    cinfo.err = jpeg_std_error(&failure->pub);
    failure->pub.error_exit = fail;
    failure->pub.emit_message = warn;
    if (setjmp(failure->jump)) {
        jpeg_destroy_decompress(&cinfo);
        return FAILED;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        jpeg_destroy_decompress(&cinfo);
        return UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_RGB; /* grey is repeated into the three channels */
    cinfo.scale_num = eighths;
    cinfo.scale_denom = 8;
    jpeg_calc_output_dimensions(&cinfo);
    if (box.top + box.height > cinfo.output_height || box.left + box.width > cinfo.output_width) {
        jpeg_destroy_decompress(&cinfo);
        return OUTSIDE;
    }
    jpeg_start_decompress(&cinfo);
    /* one column of context each side; crop_scanline widens the span to whole iMCUs on the left */
    x0 = box.left > 0 ? box.left - 1 : 0;
    x1 = box.left + box.width < cinfo.output_width ? box.left + box.width + 1 : cinfo.output_width;
    if (x1 - x0 < MIN_SPAN) {
        x1 = x0 + MIN_SPAN < cinfo.output_width ? x0 + MIN_SPAN : cinfo.output_width;
        x0 = x1 > MIN_SPAN ? x1 - MIN_SPAN : 0;
    }
    xoffset = x0;
    width = x1 - x0;
    jpeg_crop_scanline(&cinfo, &xoffset, &width);
    read_rows(&cinfo, out, box, xoffset);
    jpeg_destroy_decompress(&cinfo); /* aborts: the rows below the box are never read */
    return DECODED;
}

static PyObject *decode(PyObject *module, PyObject *args)
{
    Py_buffer data, out;
    int top, left, height, width, eighths, status;
    Failure failure;
    Box box;

    if (!PyArg_ParseTuple(args, "y*w*iiiii", &data, &out, &top, &left, &height, &width, &eighths))
        return NULL;
    if (top < 0 || left < 0 || height < 1 || width < 1 || eighths < 1 || eighths > 8
        || out.len != (Py_ssize_t)height * width * 3) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "decode: want top, left >= 0, height, width >= 1, eighths in 1..8 "
                                          "and out of height * width * 3 bytes");
        return NULL;
    }
    box.top = top, box.left = left, box.height = height, box.width = width;
    Py_BEGIN_ALLOW_THREADS
    status = decode_box(data.buf, (size_t)data.len, out.buf, box, eighths, &failure);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    switch (status) {
    case DECODED:
        Py_RETURN_TRUE;
    case UNSUPPORTED:
        Py_RETURN_FALSE;
    case OUTSIDE:
        PyErr_SetString(PyExc_ValueError, "decode: the box leaves the image at this scale");
        return NULL;
    default:
        PyErr_SetString(PyExc_OSError, failure.message);
        return NULL;
    }
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, out, top, left, height, width, eighths) -> bool\n\n"
     "Decode the box (top, left, height, width), in pixels of the image scaled by eighths/8, of the JPEG in\n"
     "the bytes-like `data` into `out`, a writable C-contiguous buffer of height * width * 3 bytes (RGB,\n"
     "row-major). False, with `out` untouched, for a colour space libjpeg cannot convert to RGB (CMYK,\n"
     "YCCK). OSError with libjpeg's message for data it cannot decode, a truncated file included;\n"
     "ValueError for a box outside the scaled image."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg_region",
    "Decode only a box of a JPEG, at M/8 scale, with libjpeg-turbo (see vitcli.data.decoding.jpeg_region).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__jpeg_region(void)
{
    return PyModule_Create(&module);
}
