// Row-order probe (issue 30, helper h30b1): one pass over SmolLM2-135M's f32 weight shapes (540 MB,
// huge pages) per kernel, interleaved rounds, best and mean ms. A = 4 weight rows side by side
// (the old one-row tile), E = one row at a time, S<d> = A plus an ascending prefetch d bytes ahead,
// D = a plain streaming sum. Build: gcc -O2 -march=native -o probe row-order-probe.c && ./probe 10
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct {float*w;int n,k;} Mat;
static float hsum(__m512 v){return _mm512_reduce_add_ps(v);}
// A: 4 rows at once, one acc each
static void kA(const float*x,const float*w,int n,int k,float*o){
  for(int j=0;j<n;j+=4){__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
    const float*w0=w+(size_t)j*k;
    for(int p=0;p<k;p+=16){__m512 xv=_mm512_loadu_ps(x+p);
      a0=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+p),a0);a1=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+k+p),a1);
      a2=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+2*k+p),a2);a3=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+3*k+p),a3);}
    o[j]=hsum(a0);o[j+1]=hsum(a1);o[j+2]=hsum(a2);o[j+3]=hsum(a3);}}
// B: one row at a time, 4 accs
static void kB(const float*x,const float*w,int n,int k,float*o){
  for(int j=0;j<n;j++){const float*r=w+(size_t)j*k;__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;int p=0;
    for(;p+64<=k;p+=64){a0=_mm512_fmadd_ps(_mm512_loadu_ps(x+p),_mm512_loadu_ps(r+p),a0);a1=_mm512_fmadd_ps(_mm512_loadu_ps(x+p+16),_mm512_loadu_ps(r+p+16),a1);
      a2=_mm512_fmadd_ps(_mm512_loadu_ps(x+p+32),_mm512_loadu_ps(r+p+32),a2);a3=_mm512_fmadd_ps(_mm512_loadu_ps(x+p+48),_mm512_loadu_ps(r+p+48),a3);}
    for(;p<k;p+=16)a0=_mm512_fmadd_ps(_mm512_loadu_ps(x+p),_mm512_loadu_ps(r+p),a0);
    o[j]=hsum(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));}}
// C: A + prefetch D bytes ahead on each of 4 rows
static int PD=1024;
static void kC(const float*x,const float*w,int n,int k,float*o){
  for(int j=0;j<n;j+=4){__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
    const float*w0=w+(size_t)j*k; const char*pf=(const char*)w0+PD*4;
    for(int p=0;p<k;p+=16){__m512 xv=_mm512_loadu_ps(x+p);
      _mm_prefetch(pf+p*4,_MM_HINT_T0);_mm_prefetch(pf+(k+p)*4,_MM_HINT_T0);_mm_prefetch(pf+(2*k+p)*4,_MM_HINT_T0);_mm_prefetch(pf+(3*k+p)*4,_MM_HINT_T0);
      a0=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+p),a0);a1=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+k+p),a1);
      a2=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+2*k+p),a2);a3=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+3*k+p),a3);}
    o[j]=hsum(a0);o[j+1]=hsum(a1);o[j+2]=hsum(a2);o[j+3]=hsum(a3);}}
// E: one row, one acc (thaw's order)
static void kE(const float*x,const float*w,int n,int k,float*o){
  for(int j=0;j<n;j++){const float*r=w+(size_t)j*k;__m512 a0=_mm512_setzero_ps();
    for(int p=0;p<k;p+=16)a0=_mm512_fmadd_ps(_mm512_loadu_ps(x+p),_mm512_loadu_ps(r+p),a0);
    o[j]=hsum(a0);}}
// F: two rows
static void kF(const float*x,const float*w,int n,int k,float*o){
  for(int j=0;j<n;j+=2){const float*r=w+(size_t)j*k;__m512 a0=_mm512_setzero_ps(),a1=a0;
    for(int p=0;p<k;p+=16){__m512 xv=_mm512_loadu_ps(x+p);a0=_mm512_fmadd_ps(xv,_mm512_loadu_ps(r+p),a0);a1=_mm512_fmadd_ps(xv,_mm512_loadu_ps(r+k+p),a1);}
    o[j]=hsum(a0);o[j+1]=hsum(a1);}}
// S: A + sequential prefetch of the tile PD bytes ahead (monotonic), 4 lines per iteration
static void kS(const float*x,const float*w,int n,int k,float*o){
  const char*end=(const char*)(w+(size_t)n*k);
  for(int j=0;j<n;j+=4){__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
    const float*w0=w+(size_t)j*k; const char*pf=(const char*)w0+PD;
    for(int p=0;p<k;p+=16){__m512 xv=_mm512_loadu_ps(x+p);
      const char*q=pf+p*16; if(q<end){_mm_prefetch(q,_MM_HINT_T0);_mm_prefetch(q+64,_MM_HINT_T0);_mm_prefetch(q+128,_MM_HINT_T0);_mm_prefetch(q+192,_MM_HINT_T0);}
      a0=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+p),a0);a1=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+k+p),a1);
      a2=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+2*k+p),a2);a3=_mm512_fmadd_ps(xv,_mm512_loadu_ps(w0+3*k+p),a3);}
    o[j]=hsum(a0);o[j+1]=hsum(a1);o[j+2]=hsum(a2);o[j+3]=hsum(a3);}}
// D: pure stream sum (bandwidth roof)
static float sink;
static void kD(const float*x,const float*w,int n,int k,float*o){__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;size_t N=(size_t)n*k;
  for(size_t p=0;p<N;p+=64){a0=_mm512_add_ps(a0,_mm512_loadu_ps(w+p));a1=_mm512_add_ps(a1,_mm512_loadu_ps(w+p+16));a2=_mm512_add_ps(a2,_mm512_loadu_ps(w+p+32));a3=_mm512_add_ps(a3,_mm512_loadu_ps(w+p+48));}
  o[0]=hsum(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));}
int main(int argc,char**argv){
  int H=576,I=1536,L=30,V=49152; size_t tot=0; Mat m[30*7+1]; int nm=0;
  int shp[7][2]={{576,576},{192,576},{192,576},{576,576},{1536,576},{1536,576},{576,1536}};
  for(int l=0;l<L;l++)for(int i=0;i<7;i++){m[nm].n=shp[i][0];m[nm].k=shp[i][1];tot+=(size_t)m[nm].n*m[nm].k;nm++;}
  m[nm].n=V;m[nm].k=H;tot+=(size_t)V*H;nm++;
  size_t bytes=tot*4; char*buf=mmap(0,bytes+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  buf=(char*)(((size_t)buf+(2<<20)-1)&~((size_t)(2<<20)-1)); madvise(buf,bytes,MADV_HUGEPAGE);
  float*p=(float*)buf; for(size_t i=0;i<tot;i++)p[i]=(float)(i%97)*0.01f;
  for(int i=0;i<nm;i++){m[i].w=p;p+=(size_t)m[i].n*m[i].k;}
  float x[1536],o[49152]; for(int i=0;i<1536;i++)x[i]=i*0.001f;
  void(*ks[])(const float*,const float*,int,int,float*)={kA,kS,kS,kE,kS,kD}; int pds[]={0,4608,9216,0,18432,0};
  const char*nm_[]={"A 4row","S4608","S9216","E 1row1acc","S18432","D stream"};
  int R=argc>1?atoi(argv[1]):10; double best[6],sum[6]={0};for(int i=0;i<6;i++)best[i]=1e9;
  for(int r=0;r<R;r++)for(int q=0;q<6;q++){PD=pds[q];double t0=now();for(int i=0;i<nm;i++)ks[q](x,m[i].w,m[i].n,m[i].k,o);double t=now()-t0;sink+=o[0];if(t<best[q])best[q]=t;sum[q]+=t;}
  for(int q=0;q<6;q++)printf("%-10s best %.2f ms (%.1f GB/s) mean %.2f ms\n",nm_[q],best[q]*1e3,bytes/best[q]/1e9,sum[q]/R*1e3);
}
